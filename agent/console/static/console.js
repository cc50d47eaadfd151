// atlas-edge console: live pages over Server-Sent Events. Everything a box sent is written with textContent
// (never as markup), and links are built with encodeURIComponent: a box's strings stay text.
"use strict";

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  return node;
}

function dash(value) { return value === null || value === undefined || value === "" ? "-" : value; }

// A burst of changes is drawn once, 300 ms after its first: the changes that arrive meanwhile are merged into
// it (their boxes added; null, "any box", wins), so a box page never misses its box's change for another's.
function live(version, onChange) {
  let pending = null;
  const source = new EventSource("/live?v=" + encodeURIComponent(version));
  source.addEventListener("change", (event) => {
    const change = JSON.parse(event.data);
    if (pending) {
      pending.version = change.version;
      pending.devices = pending.devices === null || change.devices === null ? null
        : pending.devices.concat(change.devices);
      return;
    }
    pending = change;
    setTimeout(() => { const burst = pending; pending = null; onChange(burst); }, 300);
  });
}

function fleetRow(r) {
  const tr = el("tr", null, {"data-device": r.device, "class": "state-" + r.state});
  const link = el("a", r.device, {"href": "/box/" + encodeURIComponent(r.device)});
  const device = el("td", null, {"class": "device"});
  device.appendChild(link);
  tr.appendChild(device);
  tr.appendChild(el("td", r.state, {"class": "state"}));
  tr.appendChild(el("td", r.groups.join(", "), {"class": "groups"}));
  tr.appendChild(el("td", dash(r.kind), {"class": "kind"}));
  tr.appendChild(el("td", dash(r.model), {"class": "model"}));
  tr.appendChild(el("td", dash(r.version), {"class": "version"}));
  tr.appendChild(el("td", dash(r.precision), {"class": "precision"}));
  tr.appendChild(el("td", r.fps === null ? "-" : r.fps.toFixed(1), {"class": "fps"}));
  tr.appendChild(el("td", r.sources, {"class": "sources" + (r.sources_ok ? "" : " sources-bad"),
    "title": r.sources_note}));
  tr.appendChild(el("td", r.alerts, {"class": "alerts", "title": r.last_alert || ""}));
  tr.appendChild(el("td", r.seen, {"class": "seen"}));
  return tr;
}

function emptyRow(text, columns) {
  const tr = el("tr");
  tr.appendChild(el("td", text, {"colspan": String(columns), "class": "none"}));
  return tr;
}

function showLinkError(text) {
  const node = document.getElementById("link-error");
  node.textContent = text || "";
  node.hidden = !text;
}

function fleetPage() {
  const table = document.getElementById("fleet");
  live(table.dataset.version, async () => {
    const answer = await fetch("/api/fleet" + window.location.search, {credentials: "same-origin"});
    if (!answer.ok) return;
    const data = await answer.json();
    const body = document.getElementById("rows");
    body.replaceChildren(...data.rows.map(fleetRow));
    document.getElementById("total").textContent = data.total;
    table.dataset.version = data.version;
    showLinkError(data.error);
  });
}

function fill(id, items, line) {
  const list = document.getElementById(id);
  if (!list) return;
  const nodes = items.map((item) => el("li", line(item)));
  list.replaceChildren(...(nodes.length ? nodes : [el("li", "none", {"class": "none"})]));
}

function boxPage() {
  const head = document.getElementById("device");
  const device = head.dataset.device;
  const csrf = document.body.dataset.csrf;
  async function refresh() {
    const answer = await fetch("/api/box/" + encodeURIComponent(device), {credentials: "same-origin"});
    if (!answer.ok) return;
    const box = await answer.json();
    const r = box.row;
    const fields = {"box-state": r.state, "box-reason": box.reason, "box-groups": r.groups.join(", "),
      "box-kind": r.kind, "box-model": r.model, "box-version": r.version, "box-precision": r.precision,
      "box-backend": box.backend, "box-fps": r.fps === null ? null : r.fps.toFixed(1), "box-broker": box.broker};
    for (const [id, value] of Object.entries(fields)) document.getElementById(id).textContent = dash(value);
    fill("alerts", box.alerts, (a) => a);
    document.getElementById("slot-rows").replaceChildren(...Object.keys(box.slots).sort().map((name) => {
      const slot = box.slots[name];
      const tr = el("tr");
      tr.appendChild(el("td", name + (name === box.serving_slot ? " (serving)" : "")));
      tr.appendChild(el("td", dash(slot.version)));
      tr.appendChild(el("td", slot.state));
      tr.appendChild(el("td", dash(slot.sha256), {"class": "sha"}));
      return tr;
    }));
    document.getElementById("last-rollback").textContent = "Last rollback: " + (box.last_rollback || "none");
    fill("results", box.results, (x) => x.source + " frame " + x.frame_id + ": " +
      x.detections.map((d) => d.label + " " + (typeof d.score === "number" ? d.score.toFixed(2) : d.score)).join(", "));
    fill("command-log", box.commands, (c) => c.user + ": " + c.verb + " " + c.state + (c.error ? " (" + c.error + ")" : ""));
    const cameras = box.cameras.map((c) => {
      const tr = el("tr", null, {"class": "camera-" + c.state});
      for (const [value, cls] of [[c.name, ""], [c.state, "state"], [c.fps_in === null ? "-" : c.fps_in.toFixed(1), ""],
        [dash(c.error), ""]]) tr.appendChild(el("td", value, cls ? {"class": cls} : {}));
      return tr;
    });
    document.getElementById("camera-rows").replaceChildren(...(cameras.length ? cameras :
      [emptyRow("no telemetry heard yet", 4)]));
    const shots = document.getElementById("snapshots");
    const figures = box.pictures.map((source) => {
      const figure = el("figure");
      figure.appendChild(el("img", null, {"class": "snapshot", "alt": "snapshot of " + source,
        "src": "/box/" + encodeURIComponent(device) + "/picture/" + encodeURIComponent(source) + "?v=" + box.version}));
      figure.appendChild(el("figcaption", source));
      return figure;
    });
    if (figures.length) shots.replaceChildren(...figures);
    const refused = document.getElementById("refused-snapshot");
    refused.textContent = box.refused_snapshot || "";
    refused.hidden = !box.refused_snapshot;
  }
  live(head.dataset.version, (change) => {
    if (change.devices === null || change.devices.includes(device)) refresh();
  });
  for (const button of document.querySelectorAll("button.verb")) {
    button.addEventListener("click", async () => {
      const verb = button.dataset.verb;
      if ((verb === "rollback" || verb === "restart") && !window.confirm(verb + " " + device + "?")) return;
      const out = document.getElementById("command-answer");
      out.textContent = verb + ": sent, waiting for the box's final ack";
      const answer = await fetch("/box/" + encodeURIComponent(device) + "/command", {
        method: "POST", credentials: "same-origin",
        headers: {"Content-Type": "application/json", "X-CSRF-Token": csrf},
        body: JSON.stringify({verb: verb, fields: {}})});
      const data = await answer.json();
      out.textContent = verb + ": " + (data.state || "") + (data.error ? " (" + data.error + ")" : "");
      out.dataset.state = data.state || "error";
      refresh();
    });
  }
}

function counts(map) {
  const names = Object.keys(map).sort();
  return names.length ? names.map((name) => name + " " + map[name]).join(", ") : "-";
}

function waveTable(w) {
  const table = el("table", null, {"class": "wave", "data-wave": String(w.index)});
  table.appendChild(el("caption", "Wave " + w.index + (w.canary ? " (canary)" : "") + ": " + w.size + " box(es)"));
  const head = el("tr");
  for (const name of ["Device", "State", "From", "To", "Serves", "Error"]) head.appendChild(el("th", name));
  table.appendChild(el("thead")).appendChild(head);
  const body = el("tbody");
  for (const b of w.boxes) {
    const tr = el("tr", null, {"data-device": b.device, "class": "box-" + b.state});
    const device = el("td");
    device.appendChild(el("a", b.device, {"href": "/box/" + encodeURIComponent(b.device)}));
    tr.appendChild(device);
    tr.appendChild(el("td", b.state + (b.reverted ? " (reverted)" : ""), {"class": "state"}));
    tr.appendChild(el("td", dash(b.old_version)));
    tr.appendChild(el("td", dash(b.new_version)));
    tr.appendChild(el("td", dash(b.serving), {"class": "serving"}));
    tr.appendChild(el("td", dash(b.error)));
    body.appendChild(tr);
  }
  table.appendChild(body);
  return table;
}

function rolloutPage() {
  const head = document.getElementById("rollout");
  const id = head.dataset.rollout;
  const csrf = document.body.dataset.csrf;
  async function refresh() {
    const answer = await fetch("/api/rollouts/" + encodeURIComponent(id), {credentials: "same-origin"});
    if (!answer.ok) return;
    const r = await answer.json();
    const status = document.getElementById("rollout-status");
    status.textContent = r.status;
    status.className = "status-" + r.status;
    for (const name of ["group", "bundle", "sha256"]) document.getElementById("r-" + name).textContent = dash(r.spec[name]);
    document.getElementById("rollout-counts").textContent = counts(r.counts);
    document.getElementById("rollout-driven").textContent = r.driven ? "by a running process" : "by no process now";
    document.getElementById("rollout-abort").textContent = r.abort ? r.abort.reason : "-";
    const waves = r.waves.map(waveTable);
    document.getElementById("waves").replaceChildren(...(waves.length ? waves : [el("p", "not planned yet", {"class": "none"})]));
    fill("outside", r.outside, (b) => b.device + ": " + b.state + (b.error ? " (" + b.error + ")" : ""));
    document.getElementById("rollout-log").textContent = r.log.join("\n");
    for (const button of document.querySelectorAll("button.rollout-action")) {
      button.hidden = !r.actions.includes(button.dataset.action);
    }
  }
  let pending = null;
  const source = new EventSource("/live/rollouts/" + encodeURIComponent(id));
  source.addEventListener("change", () => {
    if (pending) return;
    pending = setTimeout(() => { pending = null; refresh(); }, 200);
  });
  for (const button of document.querySelectorAll("button.rollout-action")) {
    button.addEventListener("click", async () => {
      const action = button.dataset.action;
      if ((action === "cancel" || action === "revert") && !window.confirm(action + " rollout " + id + "?")) return;
      const out = document.getElementById("rollout-answer");
      out.textContent = action + ": asked";
      delete out.dataset.state;
      const answer = await fetch("/rollouts/" + encodeURIComponent(id) + "/" + action, {
        method: "POST", credentials: "same-origin", headers: {"X-CSRF-Token": csrf}});
      const data = await answer.json();
      out.textContent = action + ": " + (data.ok ? "ok" : "refused") + (data.said || data.error ? " (" + (data.said || data.error) + ")" : "");
      out.dataset.state = data.ok ? "ok" : "refused";
      refresh();
    });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const page = document.body.dataset.page;
  if (page === "fleet") fleetPage();
  if (page === "box") boxPage();
  if (page === "rollout") rolloutPage();
});
