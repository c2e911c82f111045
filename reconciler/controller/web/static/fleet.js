// The fleet page's script: filters as you type, live sections over server-sent events, and
// ticking health clocks. No framework and no build step; the page works without it (the
// filters then submit, and a reload shows the latest state).
"use strict";
(function () {
  const SECTIONS = ["live", "grid", "commits"];
  const form = document.getElementById("filters");

  function applyFilters() {
    if (!form) return;
    const q = form.elements.q.value.trim().toLowerCase();
    const label = form.elements.label.value;
    document.querySelectorAll("#grid").forEach(function (grid) {
      let shown = 0;
      grid.querySelectorAll("tr.host-row").forEach(function (row) {
        const labels = (row.dataset.labels || "").split(" ");
        const ok = (!label || labels.indexOf(label) >= 0) && (!q || (row.dataset.search || "").indexOf(q) >= 0);
        row.hidden = !ok;
        if (ok) shown += 1;
      });
      grid.querySelectorAll(".n-shown").forEach(function (el) { el.textContent = String(shown); });
    });
  }

  // The label choices follow the fleet: a push can add hosts and labels after the page loaded.
  function refreshLabels() {
    if (!form) return;
    const select = form.elements.label;
    const seen = new Set();
    document.querySelectorAll("#grid tr.host-row").forEach(function (row) {
      (row.dataset.labels || "").split(" ").forEach(function (l) { if (l) seen.add(l); });
    });
    if (select.value) seen.add(select.value);
    const want = Array.from(seen).sort();
    const have = Array.from(select.options).slice(1).map(function (o) { return o.value; });
    if (want.join(" ") === have.join(" ")) return;
    const chosen = select.value;
    while (select.options.length > 1) select.remove(1);
    want.forEach(function (l) { select.add(new Option(l, l, false, l === chosen)); });
  }

  function keepInUrl() {
    const params = new URLSearchParams();
    if (form.elements.label.value) params.set("label", form.elements.label.value);
    if (form.elements.q.value) params.set("q", form.elements.q.value);
    const query = params.toString();
    history.replaceState(null, "", query ? "?" + query : location.pathname);
  }

  if (form) {
    form.addEventListener("input", function () { applyFilters(); keepInUrl(); });
    form.addEventListener("change", function () { applyFilters(); keepInUrl(); });
    form.addEventListener("submit", function (ev) { ev.preventDefault(); applyFilters(); keepInUrl(); });
  }

  // Health clocks: the server sends the seconds elapsed when it rendered; count on from there.
  function stamp(root) {
    const now = performance.now();
    root.querySelectorAll(".clock[data-elapsed]").forEach(function (el) { el.dataset.t0 = String(now); });
  }
  function tick() {
    const now = performance.now();
    document.querySelectorAll(".clock[data-elapsed]").forEach(function (el) {
      const t = parseFloat(el.dataset.elapsed) + (now - parseFloat(el.dataset.t0 || now)) / 1000;
      el.textContent = Math.floor(t) + "s" + (el.dataset.timeout ? " / " + el.dataset.timeout + "s" : "");
    });
  }
  stamp(document);
  setInterval(tick, 1000);

  const url = document.body.dataset.events;
  const conn = document.getElementById("conn");
  function say(text, on) {
    if (!conn) return;
    conn.hidden = false;
    conn.textContent = text;
    conn.className = "conn " + (on ? "on" : "off");
  }
  // The versions this page shows: what a new stream asks to be brought up from.
  const initial = new URLSearchParams(url ? url.split("?")[1] || "" : "");
  function eventsUrl() {
    return "/events?" + SECTIONS.map(function (name) {
      const el = document.getElementById(name);
      const v = el && el.dataset.version ? el.dataset.version : initial.get(name) || "";
      return name + "=" + encodeURIComponent(v);
    }).join("&");
  }
  function connect() {
    const source = new EventSource(eventsUrl());
    source.onopen = function () { say("live", true); };
    source.onerror = function () {
      if (source.readyState !== EventSource.CLOSED) { say("reconnecting…", false); return; }
      // Refused (503: the daemon caps its live viewers) or an answer that is not a stream: the
      // browser gives up on its own; try again in a while, jittered so viewers do not return at once.
      say("not live (too many viewers?): retrying in 30 s", false);
      setTimeout(connect, 30000 + Math.random() * 10000);
    };
    SECTIONS.forEach(function (name) {
      source.addEventListener(name, function (ev) {
        const el = document.getElementById(name);
        if (!el) return;
        el.innerHTML = ev.data;      // HTML the server rendered and escaped
        el.dataset.version = ev.lastEventId;
        stamp(el);
        if (name === "grid") { refreshLabels(); applyFilters(); }
        document.body.dataset.updates = String(parseInt(document.body.dataset.updates, 10) + 1);
      });
    });
  }
  if (url && window.EventSource) {
    document.body.dataset.updates = "0";
    connect();
  }
})();
