"""One log line per refused request instead of hivemind's traceback.

hivemind's P2P layer logs every exception a handler raises at WARNING with a full
traceback ("Handler failed with the exception:"). For a request this server refuses on
purpose (`RequestError`: a bad shape, an unknown block, a session over its length;
`AllocationFailed`: no room in the cache budget within the caller's alloc_timeout) that
is noise, and a peer sending bad requests on a loop could fill the server's log with
tracebacks. `RefusedRequestFilter` turns those records into one INFO line carrying the
reason; every other exception keeps its traceback. It matches hivemind 1.1's logger name
and message: re-check them on a hivemind upgrade (a test does). hivemind logs nothing for a
unary handler's exception (it only sends it back): `logged_refusal` gives those the same line.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from distconf.server.memory import AllocationFailed
from distconf.server.validation import RequestError

__all__ = ["HIVEMIND_P2P_LOGGER", "REFUSALS", "RefusedRequestFilter", "install_refused_request_filter",
           "logged_refusal"]

logger = logging.getLogger(__name__)
_LINE = "refused a request: %s"
_SHOWN = 300  # characters of the reason in the log line

HIVEMIND_P2P_LOGGER = "hivemind.p2p.p2p_daemon"
"""The logger hivemind's P2P handlers report exceptions to."""
REFUSALS: tuple[type[Exception], ...] = (RequestError, AllocationFailed)
"""Exceptions that mean "this request is refused", not "the server failed"."""


class RefusedRequestFilter(logging.Filter):
    """Rewrites hivemind's record of a refused request (`REFUSALS`) into a one-line INFO record."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Always keep the record; shorten it when it is a refused request."""
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, REFUSALS):
            record.msg, record.args = _LINE, (str(exc)[:_SHOWN],)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def install_refused_request_filter() -> None:
    """Install `RefusedRequestFilter` on hivemind's P2P logger (once per process)."""
    target = logging.getLogger(HIVEMIND_P2P_LOGGER)
    if not any(isinstance(f, RefusedRequestFilter) for f in target.filters):
        target.addFilter(RefusedRequestFilter())


@contextlib.contextmanager
def logged_refusal(what: str) -> Iterator[None]:
    """Log a refusal (`REFUSALS`) raised inside as one INFO line naming ``what``, and let it go on to the caller."""
    try:
        yield
    except REFUSALS as exc:
        logger.info(_LINE, f"{what}: {str(exc)[:_SHOWN]}")
        raise
