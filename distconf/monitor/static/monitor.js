// distconf swarm monitor: renders /api/v1/state and refreshes it in place (no full reload).
// Every value from the swarm is untrusted: it is only ever set as text (textContent), never as HTML.
"use strict";

(function () {
  const PAGE = 50;            // servers per page
  const MAX_SEGMENTS = 200;   // a longer model is drawn with one segment per group of blocks
  const offsets = new Map();  // dht_prefix -> servers_offset chosen with the pager
  let last = null;            // last state received
  let receivedAt = 0;         // performance.now() when it was received
  let timer = null;

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "text") node.textContent = value;
      else if (key === "class") node.className = value;
      else node.setAttribute(key, value);
    }
    for (const child of children || []) node.appendChild(child);
    return node;
  }

  function fmt(value, digits) {
    if (value === null || value === undefined) return "\u2013";
    return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits === undefined ? 2 : digits });
  }

  function coverageClass(online, joining) {
    if (online >= 3) return "cov-3";
    if (online === 2) return "cov-2";
    if (online === 1) return "cov-1";
    return joining > 0 ? "cov-j" : "cov-0";
  }
  const RANK = { "cov-0": 0, "cov-j": 1, "cov-1": 2, "cov-2": 3, "cov-3": 4 };

  function coverageBar(model) {
    const n = model.num_blocks;
    const per = Math.max(1, Math.ceil(n / MAX_SEGMENTS));
    const bar = el("div", { class: "bar", role: "img",
      "aria-label": `coverage of ${n} blocks: ${model.blocks_covered} covered by online servers` });
    for (let start = 0; start < n; start += per) {
      const end = Math.min(n, start + per);
      let worst = "cov-3", minOnline = Infinity, joining = 0;
      for (let b = start; b < end; b++) {
        const cls = coverageClass(model.online_per_block[b], model.joining_per_block[b]);
        if (RANK[cls] < RANK[worst]) worst = cls;
        minOnline = Math.min(minOnline, model.online_per_block[b]);
        joining += model.joining_per_block[b];
      }
      const label = end - start === 1 ? `block ${start}` : `blocks ${start}..${end - 1}`;
      bar.appendChild(el("span", { class: worst, "data-online": String(minOnline),
        "data-blocks": `${start}-${end - 1}`, title: `${label}: ${minOnline} online` +
          (per > 1 ? " (fewest in the group)" : "") + (joining ? `, ${joining} joining` : "") }));
    }
    const axis = el("div", { class: "axis" }, [el("span", { text: "0" }),
      el("span", { text: per > 1 ? `${per} blocks per segment` : "" }), el("span", { text: String(n - 1) })]);
    return [bar, axis];
  }

  function pings(server) {
    const entries = Object.entries(server.next_pings || {});
    if (!entries.length) return "\u2013";
    return entries.slice(0, 3).map(([peer, rtt]) =>
      `..${peer.slice(-6)} ${rtt === null ? "failed" : (rtt * 1000).toFixed(0) + " ms"}`).join(", ") +
      (entries.length > 3 ? ` +${entries.length - 3}` : "");
  }

  function serverTable(model) {
    const head = ["peer", "name", "blocks", "state", "reached", "rps", "cache left", "dtype / quant", "version", "pings"];
    const numeric = new Set(["rps", "cache left"]);
    const narrowHidden = new Set(["dtype / quant", "version", "pings"]);
    const cls = (h) => [numeric.has(h) ? "num" : "", narrowHidden.has(h) ? "hide-narrow" : ""].join(" ").trim();
    const rows = model.servers.map((s) => el("tr", { "data-peer": s.peer_id }, [
      el("td", { text: s.peer_id_short, title: s.peer_id }),
      el("td", { class: "name", text: s.public_name || "\u2013", title: s.public_name || "" }),
      el("td", { text: s.end - s.start === 1 ? `${s.start}` : `${s.start}..${s.end - 1}` }),
      el("td", { class: `state-${s.state}`, text: s.state }),
      el("td", { class: "reached", text: s.using_relay === true ? "relay" : s.using_relay === false ? "direct" : "\u2013",
                 title: s.using_relay ? "peers reach it through a libp2p relay (its rps counts x0.2)" : "" }),
      el("td", { class: "num", text: fmt(s.throughput) }),
      el("td", { class: "num", text: fmt(s.cache_tokens_left, 0) }),
      el("td", { class: "hide-narrow", text: [s.torch_dtype, s.quant_type].filter(Boolean).join(" / ") || "\u2013" }),
      el("td", { class: "hide-narrow", text: s.version || "\u2013" }),
      el("td", { class: "hide-narrow", text: pings(s) }),
    ]));
    const table = el("table", {}, [
      el("thead", {}, [el("tr", {}, head.map((h) => el("th", { class: cls(h), text: h })))]),
      el("tbody", {}, rows),
    ]);
    const parts = [el("div", { class: "tablewrap" }, [table])];
    if (model.servers_total > model.servers.length || model.servers_offset > 0) {
      const from = model.servers_offset, to = from + model.servers.length;
      const prev = el("button", { type: "button", text: "previous" });
      const next = el("button", { type: "button", text: "next" });
      prev.disabled = from === 0;
      next.disabled = to >= model.servers_total;
      prev.addEventListener("click", () => { offsets.set(model.dht_prefix, Math.max(0, from - PAGE)); refresh(); });
      next.addEventListener("click", () => { offsets.set(model.dht_prefix, from + PAGE); refresh(); });
      parts.push(el("div", { class: "pager" }, [prev,
        el("span", { text: `servers ${to > from ? from + 1 : 0}\u2013${to} of ${model.servers_total}` }), next]));
    }
    return parts;
  }

  function ago(seconds) {
    if (seconds < 90) return `${Math.max(0, seconds).toFixed(0)} s ago`;
    if (seconds < 5400) return `${(seconds / 60).toFixed(0)} min ago`;
    return `${(seconds / 3600).toFixed(1)} h ago`;
  }

  // Servers that clients say their spot checks caught: claims by clients (anyone can publish one), shown as such.
  function caughtTable(model) {
    const caught = model.caught || [];
    if (!caught.length) return [];
    const now = Date.now() / 1000;
    const rows = caught.map((c) => el("tr", { "data-peer": c.peer_id }, [
      el("td", { text: c.peer_id_short, title: c.peer_id }),
      el("td", { text: c.end - c.start === 1 ? `${c.start}` : `${c.start}..${c.end - 1}` }),
      el("td", { class: "num", text: String(c.reports),
        title: `${c.detections} detection(s) by ${c.reports} client(s): ` +
          c.reporters.map((p) => `..${p.slice(-6)}`).join(", ") }),
      el("td", { text: ago(now - c.last_seen), title: new Date(c.last_seen * 1000).toLocaleString() }),
      el("td", { class: "num hide-narrow", text: c.max_difference === null ? "non-finite" : fmt(c.max_difference, 3) }),
      el("td", { class: "hide-narrow", text: c.kinds.join(", ") }),
    ]));
    const head = [["peer", ""], ["span", ""], ["reports", "num"], ["last seen", ""],
      ["difference", "num hide-narrow"], ["checked", "hide-narrow"]];
    const table = el("table", { class: "caught" }, [
      el("thead", {}, [el("tr", {}, head.map(([h, cls]) => el("th", { class: cls, text: h })))]),
      el("tbody", {}, rows),
    ]);
    const more = model.caught_total > caught.length ? ` (the latest ${caught.length} of ${model.caught_total})` : "";
    return [
      el("h3", { text: "Caught by clients" + more }),
      el("p", { class: "claim", text: "Client claims: servers whose results clients' spot checks found wrong. " +
        "Any peer can publish such a report, so it is a hint, not a proof; a client that verifies checks " +
        "every server itself." }),
      el("div", { class: "tablewrap caughtwrap" }, [table]),
    ];
  }

  function cacheFigures(model) {  // what a block keeps per session (bfloat16), when the config is known
    const out = [];
    if (model.kv_bytes_per_token) {
      out.push(`K/V ${fmt(model.kv_bytes_per_token, 0)} B/token/block` +
        (model.state_blocks ? ` (${model.kv_blocks} blocks)` : ""));
    }
    if (model.state_bytes_per_sequence) {
      out.push(`state ${fmt(model.state_bytes_per_sequence, 0)} B/sequence/block` +
        (model.kv_blocks ? ` (${model.state_blocks} blocks)` : ""));
    }
    return out;
  }

  function modelSection(model) {
    const route = model.route;
    const routeText = route.exists
      ? `full route: ${route.hops} hop(s), bottleneck ${fmt(route.bottleneck_rps)} rps`
      : `no full route` + (route.first_gap !== null ? ` (first gap: block ${route.first_gap})` : "");
    const peers = model.peers_by_state;
    const meta = [model.listed ? "listed" : "named on the command line", `${model.num_blocks} blocks`];
    if (model.repository) meta.push(model.repository);
    meta.push(...cacheFigures(model));
    const children = [
      el("h2", { text: model.dht_prefix }),
      el("p", { class: "meta", text: meta.join(" \u00b7 ") }),
      el("div", { class: "summary" }, [
        el("span", { class: route.exists ? "route ok" : "route bad", text: routeText, title: route.message }),
        el("span", { text: `${model.blocks_covered}/${model.num_blocks} blocks covered` }),
        el("span", { text: `${peers.online || 0} online, ${peers.joining || 0} joining, ` +
          `${peers.offline || 0} offline peer(s)` }),
      ]),
      ...coverageBar(model),
    ];
    const warnings = [];
    if (model.error) warnings.push(`latest read failed: ${model.error}`);
    if (model.skipped_records) warnings.push(`${model.skipped_records} malformed record(s) skipped`);
    if (model.failed_blocks) warnings.push(`search failed for ${model.failed_blocks} block(s)`);
    if (model.skipped_reports) warnings.push(`${model.skipped_reports} malformed client report(s) skipped`);
    for (const w of warnings) children.push(el("p", { class: "warn", text: w }));
    children.push(...serverTable(model));
    children.push(...caughtTable(model));
    return el("section", { class: "model", "data-prefix": model.dht_prefix }, children);
  }

  function render(state) {
    const main = document.getElementById("models");
    const sections = state.models.map(modelSection);
    if (!sections.length) {
      sections.push(el("p", { text: state.read_at === null ? "reading the swarm\u2026" : "no models found" }));
    }
    if (state.models_not_read) {
      sections.push(el("p", { class: "warn", text: `${state.models_not_read} more listed model(s) not read` }));
    }
    main.replaceChildren(...sections);
    const error = document.getElementById("error");
    error.hidden = !state.error;
    error.textContent = state.error || "";
    tick();
  }

  function tick() {
    const status = document.getElementById("status");
    if (!last) return;
    if (last.age_seconds === null) { status.textContent = "reading the swarm\u2026"; return; }
    const age = last.age_seconds + (performance.now() - receivedAt) / 1000;
    const when = new Date(last.read_at * 1000).toLocaleTimeString();
    status.textContent = `read ${age.toFixed(0)} s ago (${when}) \u00b7 refreshes every ${fmt(last.refresh_seconds)} s` +
      (last.refreshing ? " \u00b7 reading now" : "");
    status.classList.toggle("stale", age > 3 * last.refresh_seconds + 5);
  }

  async function getJson(url) {
    const response = await fetch(url, { cache: "no-store" });
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    return response.json();
  }

  async function refresh() {
    clearTimeout(timer);
    try {
      const state = await getJson(`/api/v1/state?servers_limit=${PAGE}`);
      for (const [prefix, offset] of offsets) {
        const i = state.models.findIndex((m) => m.dht_prefix === prefix);
        if (i < 0 || offset === 0) continue;
        const page = await getJson(`/api/v1/state?model=${encodeURIComponent(prefix)}` +
          `&servers_offset=${offset}&servers_limit=${PAGE}`);
        if (page.models.length) state.models[i] = page.models[0];
      }
      last = state;
      receivedAt = performance.now();
      render(state);
      document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
    } catch (err) {
      const error = document.getElementById("error");
      error.hidden = false;
      error.textContent = `monitor unreachable (${err.message}); showing the last data received`;
    }
    const period = last ? Math.max(1, Math.min(last.refresh_seconds, 60)) : 2;
    timer = setTimeout(refresh, period * 1000);
  }

  document.addEventListener("DOMContentLoaded", () => {
    setInterval(tick, 1000);
    refresh();
  });
})();
