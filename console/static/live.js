// live.js: a running build's page follows the build (console/live.go).
// The page was read up to a stream sequence (data-after); the events go
// on from the next one, and each carries its sequence as its id, which
// the browser sends back as Last-Event-ID when it reconnects: nothing is
// missed or shown twice. When the build is stored as finished or cut off,
// the page reloads once and shows it as stored. The builds list's first
// page takes its rows again as they change.
"use strict";
(function () {
  var list = document.getElementById("live-list");
  if (!list || !window.EventSource) {
    return;
  }
  var body = document.getElementById("builds").tBodies[0];
  var limit = parseInt(list.dataset.limit, 10);
  function rowOf(key) {
    for (var i = 0; i < body.rows.length; i++) {
      if (body.rows[i].dataset.key === key) {
        return body.rows[i];
      }
    }
    return null;
  }
  var es = new EventSource(list.dataset.events);
  es.onopen = function () { list.className = "on"; list.textContent = "Live: running builds update as they go."; };
  es.onerror = function () { list.className = "off"; list.textContent = "Live: connection lost, reconnecting…"; };
  es.addEventListener("build", function (e) {
    var d = JSON.parse(e.data);
    var none = body.querySelector("tr.none");
    if (none) {
      none.remove();
    }
    var tmp = document.createElement("tbody");
    tmp.innerHTML = d.html;
    var tr = tmp.rows[0];
    var old = rowOf(d.key);
    if (old) {
      old.remove();
    }
    var at = parseInt(d.index, 10);
    body.insertBefore(tr, body.rows[at] || null);
    while (body.rows.length > limit) {
      body.deleteRow(-1);
    }
  });
  es.addEventListener("gone", function (e) {
    var old = rowOf(JSON.parse(e.data).key);
    if (old) {
      old.remove();
    }
  });
})();
(function () {
  var live = document.getElementById("live");
  if (!live || !window.EventSource) {
    return;
  }
  var log = document.getElementById("log");
  var maxLog = 1 << 20; // characters of output kept on the page
  var note = document.createElement("span");
  live.appendChild(note);
  note.textContent = "Live: following the build as Bazel sends it.";

  // rowOf finds a table's row for a label, or null.
  function rowOf(table, label) {
    var rows = table.tBodies[0].rows;
    for (var i = 0; i < rows.length; i++) {
      if (rows[i].dataset.label === label) {
        return rows[i];
      }
    }
    return null;
  }

  // put replaces a label's row, or adds it first, when the table shows
  // its first page and the row passes its filter.
  function put(id, d, keep) {
    var table = document.getElementById(id);
    if (!table || table.dataset.live !== "true" || !keep(table.dataset.filter || "")) {
      return;
    }
    var body = table.tBodies[0];
    var none = body.querySelector("tr.none");
    if (none) {
      none.remove();
    }
    var old = rowOf(table, d.label);
    var tmp = document.createElement("tbody");
    tmp.innerHTML = d.html;
    var tr = tmp.rows[0];
    if (old) {
      old.replaceWith(tr);
    } else {
      body.insertBefore(tr, body.firstChild);
    }
  }

  var url = live.dataset.events + "?after=" + encodeURIComponent(live.dataset.after);
  var es = new EventSource(url);
  // What the page has taken in: connections opened, events applied, the
  // last event's id (the stream sequence a reconnection goes on from).
  live.dataset.opens = "0";
  live.dataset.applied = "0";
  live.dataset.last = live.dataset.after;
  function took(e) {
    live.dataset.applied = String(parseInt(live.dataset.applied, 10) + 1);
    if (e.lastEventId) {
      live.dataset.last = e.lastEventId;
    }
  }
  es.onopen = function () {
    renewing = false;
    live.dataset.opens = String(parseInt(live.dataset.opens, 10) + 1);
    note.textContent = "Live: following the build as Bazel sends it.";
    live.className = "on";
  };
  // renewing: the server said it ends this connection (it does so every
  // few minutes); the reconnection that follows is no news.
  var renewing = false;
  es.onerror = function () {
    // EventSource reconnects by itself, from the last id it saw.
    if (!renewing) {
      note.textContent = "Live: connection lost, reconnecting…";
      live.className = "off";
    }
  };
  es.addEventListener("renew", function () {
    renewing = true;
  });
  es.addEventListener("output", function (e) {
    took(e);
    var d = JSON.parse(e.data);
    var atEnd = window.innerHeight + window.scrollY >= document.body.scrollHeight - 4;
    log.insertAdjacentHTML("beforeend", d.html);
    while (log.textContent.length > maxLog && log.firstChild) {
      log.removeChild(log.firstChild);
    }
    if (atEnd) {
      window.scrollTo(0, document.body.scrollHeight);
    }
  });
  es.addEventListener("target", function (e) {
    took(e);
    var d = JSON.parse(e.data);
    put("targets-table", d, function (f) { return f !== "failed" || d.success !== "true"; });
  });
  es.addEventListener("test", function (e) {
    took(e);
    var d = JSON.parse(e.data);
    put("tests-table", d, function (f) {
      return f === "" || (f === "not-passed" ? d.status !== "PASSED" : d.status === f);
    });
  });
  es.addEventListener("status", function (e) {
    took(e);
    var d = JSON.parse(e.data);
    var s = document.getElementById("status");
    s.textContent = d.status;
    s.className = "status " + d.status;
    document.getElementById("state").textContent = d.state;
  });
  // The summary's counts as projected (not a stream event: no took).
  es.addEventListener("counts", function (e) {
    var d = JSON.parse(e.data);
    document.getElementById("count-targets").innerHTML = d.targets;
    document.getElementById("count-tests").innerHTML = d.tests;
  });
  es.addEventListener("end", function () {
    es.close();
    note.textContent = "The build is stored: reloading.";
    window.location.reload();
  });
})();
