// The console's own script: the terminal (xterm.js over the sandbox's WebSocket), a region that
// refreshes itself while an operation runs, and confirmations. Pages work without it otherwise.
(function () {
  "use strict";

  // A sandbox's terminal: bytes both ways as binary messages, a resize as a text message.
  var el = document.getElementById("terminal");
  if (el && window.Terminal) {
    var term = new window.Terminal({ convertEol: false, cursorBlink: true, fontSize: 14 });
    var fit = window.FitAddon ? new window.FitAddon.FitAddon() : null;
    if (fit) term.loadAddon(fit);
    term.open(el);
    if (fit) fit.fit();
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    var ws = new WebSocket(scheme + location.host + el.dataset.ws);
    ws.binaryType = "arraybuffer";
    var enc = new TextEncoder();
    var sendSize = function () {
      if (ws.readyState === 1) ws.send(JSON.stringify({ cols: term.cols, rows: term.rows }));
    };
    ws.onopen = function () { el.dataset.state = "open"; sendSize(); term.focus(); };
    ws.onmessage = function (m) {
      if (typeof m.data === "string") term.write(m.data);
      else term.write(new Uint8Array(m.data));
    };
    ws.onclose = function () { el.dataset.state = "closed"; term.write("\r\n[disconnected]\r\n"); };
    term.onData(function (d) { if (ws.readyState === 1) ws.send(enc.encode(d)); });
    term.onResize(sendSize);
    window.addEventListener("resize", function () { if (fit) fit.fit(); });
    window.airlockTerminal = term;
  }

  // A session's output, live: SSE text appended as it comes; its exit said once.
  var out = document.getElementById("output");
  if (out && window.EventSource) {
    var source = new EventSource(out.dataset.stream);
    source.addEventListener("out", function (e) { out.textContent += e.data; });
    source.addEventListener("exit", function (e) {
      document.getElementById("exit").textContent = e.data;
      out.dataset.state = "exited";
      source.close();
    });
  }

  // While something settles (an operation, a sandbox starting), its region is fetched again.
  function refresh() {
    var region = document.querySelector("[data-refresh]");
    if (!region) return;
    var every = parseInt(region.dataset.refresh, 10) * 1000 || 2000;
    setTimeout(function () {
      fetch(location.href, { credentials: "same-origin" })
        .then(function (r) { return r.text(); })
        .then(function (html) {
          var doc = new DOMParser().parseFromString(html, "text/html");
          var fresh = doc.getElementById(region.id);
          // Settled: the whole page again (a running sandbox's terminal and files appear).
          if (!fresh || !fresh.hasAttribute("data-refresh")) { location.reload(); return; }
          region.replaceWith(fresh);
          refresh();
        })
        .catch(function () { refresh(); });
    }, every);
  }
  refresh();

  // An error page's Back link: the page before, where there is one.
  document.addEventListener("click", function (e) {
    var a = e.target.closest && e.target.closest("a[data-back]");
    if (a && window.history.length > 1) { e.preventDefault(); window.history.back(); }
  });

  document.addEventListener("submit", function (e) {
    var b = e.submitter;
    if (b && b.dataset.confirm && !window.confirm(b.dataset.confirm)) e.preventDefault();
  });
})();
