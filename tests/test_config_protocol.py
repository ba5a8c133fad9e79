"""`DistributedConfig` describes every synthesized config, and only those."""

from __future__ import annotations

import pytest
import transformers

import distconf
from distconf.loader.config_protocol import DistributedConfig


@pytest.mark.parametrize("family", distconf.list_families())
def test_every_family_satisfies_the_protocol(family: str) -> None:
    config = distconf.load_family(family)()
    assert isinstance(config, DistributedConfig)
    assert config.family_spec.family == family


def test_a_plain_hugging_face_config_does_not() -> None:
    assert not isinstance(transformers.LlamaConfig(), DistributedConfig)
