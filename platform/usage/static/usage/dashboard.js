/* Usage dashboard: draws the figures and Chart.js charts, re-fetches on control changes and follows
   live updates pushed over the WebSocket /ws/usage/ (the page works without it, on its initial data).
   Operator page: the key table is one server-side page (data.keys: top traffic first, search q, page);
   the key menu holds that page's keys (and the chosen one), never every key. */
(function () {
  "use strict";
  const root = document.getElementById("usage-dash");
  if (!root) return;
  const operator = root.dataset.operator === "1";
  const rangeSel = document.getElementById("usage-range");
  const keySel = document.getElementById("usage-key");
  const live = document.getElementById("usage-live");
  const searchBox = document.getElementById("usage-q");
  const pageInfo = document.getElementById("usage-page-info");
  const prevLink = document.getElementById("usage-prev");
  const nextLink = document.getElementById("usage-next");
  const tenantId = root.dataset.tenant ? parseInt(root.dataset.tenant, 10) : null;
  const keys = JSON.parse(document.getElementById("usage-keys-json").textContent || "[]");
  function keyLabel(k) { return (operator ? k.tenant + " / " : "") + k.prefix + " (" + k.name + ")" + (k.revoked ? " [revoked]" : ""); }
  const keyName = Object.fromEntries(keys.map((k) => [String(k.id), keyLabel(k)]));
  let table = { page: 1, pages: 1 };
  const charts = {};
  window.usageDashboard = { data: null, updates: 0, charts };

  function fmtTime(iso, range) {
    const d = new Date(iso);
    if (range === "30d") return d.toISOString().slice(5, 10);
    return d.toISOString().slice(11, 16);
  }
  function setText(id, value) {
    const el = document.getElementById(id);
    if (el) el.textContent = value === null || value === undefined ? "–" : String(value);
  }
  function pct(x) { return (100 * (x || 0)).toFixed(2) + " %"; }

  function chart(id, datasets, labels, stacked) {
    const ctx = document.getElementById(id);
    if (!charts[id]) {
      charts[id] = new Chart(ctx, {
        type: stacked ? "bar" : "line",
        data: { labels, datasets },
        options: {
          animation: false, responsive: true, maintainAspectRatio: false,
          interaction: { mode: "index", intersect: false },
          scales: { x: { stacked: !!stacked, ticks: { maxTicksLimit: 12 } }, y: { stacked: !!stacked, beginAtZero: true } },
          plugins: { legend: { position: "bottom" } },
          spanGaps: true,
        },
      });
    } else {
      const c = charts[id];
      c.data.labels = labels;
      datasets.forEach((ds, i) => { c.data.datasets[i].data = ds.data; });
      c.update("none");
    }
  }

  function render(data) {
    window.usageDashboard.data = data;
    const t = data.totals;
    for (const f of ["requests", "prompt_tokens", "completion_tokens", "status_429", "status_503",
                     "ttft_p50_ms", "ttft_p95_ms", "e2e_p50_ms", "e2e_p95_ms"]) setText("fig-" + f, t[f]);
    const er = document.getElementById("fig-error_rate");
    er.dataset.raw = String(t.error_rate);
    er.textContent = pct(t.error_rate);
    const pts = data.points;
    const labels = pts.map((p) => fmtTime(p.t, data.range));
    const ok = pts.map((p) => p.requests - p.status_429 - p.status_503 - p.errors);
    chart("chart-requests", [
      { label: "ok", data: ok, backgroundColor: "#4e79a7" },
      { label: "429", data: pts.map((p) => p.status_429), backgroundColor: "#f28e2b" },
      { label: "503", data: pts.map((p) => p.status_503), backgroundColor: "#e15759" },
      { label: "errors", data: pts.map((p) => p.errors), backgroundColor: "#76b7b2" },
    ], labels, true);
    chart("chart-tokens", [
      { label: "prompt", data: pts.map((p) => p.prompt_tokens), backgroundColor: "#59a14f" },
      { label: "completion", data: pts.map((p) => p.completion_tokens), backgroundColor: "#edc948" },
    ], labels, true);
    chart("chart-latency", [
      { label: "TTFT p50", data: pts.map((p) => p.ttft_p50_ms), borderColor: "#4e79a7", backgroundColor: "#4e79a7", pointRadius: 2 },
      { label: "TTFT p95", data: pts.map((p) => p.ttft_p95_ms), borderColor: "#a0cbe8", backgroundColor: "#a0cbe8", pointRadius: 2 },
      { label: "E2E p50", data: pts.map((p) => p.e2e_p50_ms), borderColor: "#e15759", backgroundColor: "#e15759", pointRadius: 2 },
      { label: "E2E p95", data: pts.map((p) => p.e2e_p95_ms), borderColor: "#ff9d9a", backgroundColor: "#ff9d9a", pointRadius: 2 },
    ], labels, false);
    const body = document.querySelector("#usage-keys tbody");
    body.replaceChildren();
    const rows = operator && data.keys
      ? data.keys.results.map((k) => { keyName[String(k.id)] = keyLabel(k); return [String(k.id), k]; })
      : Object.entries(data.groups || {});
    for (const [id, g] of rows) {
      const tr = document.createElement("tr");
      tr.dataset.keyId = id;
      const cells = [keyName[id] || (id === "0" ? "(no key)" : "#" + id), g.requests, g.prompt_tokens, g.completion_tokens,
                     g.status_429, g.status_503, g.errors, g.ttft_p50_ms, g.e2e_p50_ms];
      for (const c of cells) { const td = document.createElement("td"); td.textContent = c === null ? "–" : String(c); tr.appendChild(td); }
      body.appendChild(tr);
    }
    if (operator && data.keys) renderTable(data.keys);
  }

  function renderTable(k) {
    table = k;
    if (pageInfo) pageInfo.textContent = "page " + k.page + " of " + k.pages + " (" + k.count + " keys" + (k.q ? " matching" : "") + ")";
    if (prevLink) prevLink.hidden = k.page <= 1;
    if (nextLink) nextLink.hidden = k.page >= k.pages;
    // the key menu: all keys, the chosen key, then this page's keys
    const chosen = keySel.value;
    const kept = chosen && !k.results.some((r) => String(r.id) === chosen)
      ? Array.from(keySel.options).find((o) => o.value === chosen) : null;
    keySel.replaceChildren();
    const add = (value, text) => { const o = document.createElement("option"); o.value = value; o.textContent = text; keySel.appendChild(o); };
    add("", "all keys");
    if (kept) keySel.appendChild(kept);
    for (const r of k.results) add(String(r.id), keyLabel(r));
    keySel.value = chosen;
  }

  function view() {
    const v = { range: rangeSel.value, api_key_id: keySel.value ? parseInt(keySel.value, 10) : null, operator };
    if (operator) { v.tenant = tenantId; v.q = searchBox ? searchBox.value : ""; v.page = table.page || 1; }
    return v;
  }

  let ws = null;
  function connect() {
    const proto = location.protocol === "https:" ? "wss://" : "ws://";
    try { ws = new WebSocket(proto + location.host + root.dataset.ws); } catch (e) { return; }
    ws.onopen = () => { live.textContent = "live"; live.classList.add("on"); ws.send(JSON.stringify(view())); };
    ws.onmessage = (ev) => {
      const msg = JSON.parse(ev.data);
      if (msg && msg.points) { window.usageDashboard.updates += 1; render(msg); }
    };
    ws.onclose = (ev) => {
      live.textContent = "offline"; live.classList.remove("on"); ws = null;
      if (ev.code === 4401 || ev.code === 4403) { live.textContent = "not allowed"; return; }  // no retry loop
      setTimeout(connect, 3000);
    };
  }

  async function refetch() {
    const v = view();
    const url = root.dataset.url;
    let q = "range=" + encodeURIComponent(v.range) + (v.api_key_id ? "&api_key_id=" + v.api_key_id : "");
    if (operator) q += "&page=" + v.page + (v.q ? "&q=" + encodeURIComponent(v.q) : "");
    const resp = await fetch(url + (url.includes("?") ? "&" : "?") + q, { credentials: "same-origin" });
    if (resp.ok) render(await resp.json());
    if (ws && ws.readyState === 1) ws.send(JSON.stringify(view()));  // the page the server settled on
    const u = new URL(location.href);
    u.searchParams.set("range", v.range);
    if (v.api_key_id) u.searchParams.set("api_key_id", v.api_key_id); else u.searchParams.delete("api_key_id");
    if (operator) {
      if (table.page > 1) u.searchParams.set("page", table.page); else u.searchParams.delete("page");
      if (v.q) u.searchParams.set("q", v.q); else u.searchParams.delete("q");
    }
    history.replaceState(null, "", u);
  }

  rangeSel.addEventListener("change", refetch);
  keySel.addEventListener("change", refetch);
  if (operator) {
    let typing = null;
    if (searchBox) searchBox.addEventListener("input", () => {
      clearTimeout(typing);
      typing = setTimeout(() => { table.page = 1; refetch(); }, 300);
    });
    const turn = (delta) => (ev) => { ev.preventDefault(); table.page = Math.min(Math.max(1, table.page + delta), table.pages); refetch(); };
    if (prevLink) prevLink.addEventListener("click", turn(-1));
    if (nextLink) nextLink.addEventListener("click", turn(1));
    document.querySelector("#usage-keys tbody").addEventListener("click", (ev) => {
      const tr = ev.target.closest("tr");
      if (!tr || !tr.dataset.keyId) return;
      if (!Array.from(keySel.options).some((o) => o.value === tr.dataset.keyId)) return;
      keySel.value = tr.dataset.keyId;
      refetch();
    });
  }
  render(JSON.parse(document.getElementById("usage-initial").textContent));
  connect();
})();
