// The specprefill-queue page: overview, batch and job views. No build step, no libraries.
// Live data comes as server-sent events read with fetch (so an API key can be sent).
"use strict";

const main = document.getElementById("main");
const live = document.getElementById("live");
let current = null;  // AbortController of the view's open streams

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children.flat(Infinity)) {
    if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

function headers() {
  const key = localStorage.getItem("specprefill-api-key");
  return key ? { Authorization: "Bearer " + key } : {};
}

function askForKey() {
  const form = document.getElementById("keyform");
  form.hidden = false;
  form.onsubmit = (e) => {
    e.preventDefault();
    localStorage.setItem("specprefill-api-key", document.getElementById("apikey").value);
    form.hidden = true;
    route();
  };
}

async function api(path, asText) {
  const res = await fetch(path, { headers: headers(), signal: current && current.signal });
  if (res.status === 401) { askForKey(); throw new Error("an API key is needed"); }
  if (!res.ok) {
    let msg = res.statusText;
    try { msg = (await res.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(msg);
  }
  return asText ? res.text() : res.json();
}

// Follow a server-sent event stream; onData gets each event's parsed JSON.
async function follow(path, onData) {
  const res = await fetch(path, { headers: headers(), signal: current.signal });
  if (res.status === 401) { askForKey(); return; }
  if (!res.ok) throw new Error((await res.json()).error.message);
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  live.textContent = "live"; live.classList.add("on");
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) onData(JSON.parse(line.slice(6)));
        }
      }
    }
  } finally {
    live.textContent = "idle"; live.classList.remove("on");
  }
}

function show(...nodes) { main.replaceChildren(...nodes.flat(Infinity).filter((n) => n !== null && n !== undefined)); }
function pct(done, total) { return total > 0 ? Math.min(100, 100 * done / total) : 0; }
function bar(fraction, cls) {
  return el("span", { class: "bar " + (cls || "") }, el("span", { style: `width:${fraction.toFixed(1)}%` }));
}
function ago(ts) { return ts ? new Date(ts * 1000).toLocaleTimeString() : ""; }
function status(s) { return el("span", { class: "status-" + s, text: s }); }
function jobLink(id) { return id ? el("a", { href: "#/job/" + id, class: "mono", text: id }) : ""; }

// ---- overview ----

function table(head, rows) {
  return el("table", {}, el("tr", {}, head.map((h) => el("th", { text: h }))),
            rows.length ? rows : el("tr", {}, el("td", { class: "muted", colspan: head.length, text: "none" })));
}

function renderOverview(data) {
  const workers = data.workers.map((w) => el("tr", {},
    el("td", { class: "mono", text: w.name }), el("td", {}, status(w.state)),
    el("td", {}, ...(w.current_jobs || (w.current_job ? [w.current_job] : [])).flatMap((id, i) => i ? [" ", jobLink(id)] : [jobLink(id)])),
    el("td", { text: `${w.jobs_in_flight ?? 0} of ${w.max_jobs_in_flight ?? 1}, ${w.batch_size ?? 0} decoding` }),
    el("td", { text: `${w.successful_jobs} / ${w.failed_jobs}` }),
    el("td", { text: w.busy_seconds.toFixed(1) + " s" }),
    el("td", { class: "mono", text: w.models.filter((m) => m.loaded).map((m) => m.name).join(", ") })));
  const queues = data.queues.map((q) => el("tr", {},
    el("td", { class: "mono", text: q.name }), el("td", { text: q.queued }), el("td", { text: q.started }),
    el("td", { text: q.finished }), el("td", { text: q.failed }), el("td", { text: q.canceled })));
  const batches = data.batches.map((b) => {
    const c = b.request_counts;
    return el("tr", {}, el("td", {}, el("a", { href: "#/batch/" + b.id, class: "mono", text: b.id })),
      el("td", {}, status(b.status)), el("td", {}, bar(pct(c.completed + c.failed, c.total))),
      el("td", { text: `${c.completed} done, ${c.failed} failed of ${c.total}` }), el("td", { text: ago(b.created_at) }));
  });
  const jobs = data.recent_jobs.map((j) => el("tr", { "data-job": j.job_id },
    el("td", {}, jobLink(j.job_id)), el("td", { class: "label", text: j.label || "" }), el("td", {}, status(j.status)),
    el("td", { class: "share", text: j.ratio === null || j.ratio === undefined ? "—" : (100 * j.ratio).toFixed(1) + "%" }),
    el("td", { class: "ttft", text: j.ttft_s === null || j.ttft_s === undefined ? "—" : (1000 * j.ttft_s).toFixed(0) + " ms" }),
    el("td", { class: "ended", text: ago(j.ended_at) })));
  show(
    el("h2", { text: "Workers" }), table(["name", "state", "jobs", "in flight", "done / failed", "busy", "loaded models"], workers),
    el("h2", { text: "Queues" }), table(["queue", "waiting", "running", "finished", "failed", "canceled"], queues),
    el("h2", { text: "Batches" }), table(["batch", "status", "progress", "requests", "created"], batches),
    el("h2", { text: "Recent jobs" }), table(["job", "input", "status", "kept", "TTFT", "ended"], jobs));
}

// ---- batch view ----

function eventProgress(ev) {
  if (!ev) return ["", 0];
  const d = ev.data || {};
  if (ev.kind === "scoring") return ["draft scoring", pct(d.processed, d.total)];
  if (ev.kind === "target_prefill") return ["target prefill", pct(d.processed, d.total)];
  if (ev.kind === "decode") return ["decoding", pct(d.tokens, d.max_tokens)];
  if (ev.kind === "done") return ["done", 100];
  return [ev.kind, 0];
}

function renderBatch(snap) {
  const b = snap.batch, c = b.request_counts, p = snap.progress;
  const files = [["output", b.output_file_id], ["errors", b.error_file_id]].filter(([, id]) => id)
    .map(([label, id]) => el("a", { href: "#", "data-file": id, class: "file-link", text: `${label} file (${id})` }));
  const rows = snap.rows.map((r) => {
    const [phase, fraction] = eventProgress(r.event);
    return el("tr", { "data-status": r.status }, el("td", { text: r.line }), el("td", { class: "mono", text: r.custom_id || "" }),
      el("td", {}, status(r.status)), el("td", {}, jobLink(r.job_id)),
      el("td", {}, r.error ? el("span", { class: "muted", text: r.error }) : [bar(fraction), " ", phase]));
  });
  show(
    el("h2", {}, "Batch ", el("span", { class: "mono", text: b.id }), " ", status(b.status)),
    el("div", { id: "batch-progress", "data-done": c.completed, "data-failed": c.failed, "data-total": c.total,
                "data-status": b.status }, bar(pct(c.completed + c.failed, c.total), "big")),
    el("p", { id: "batch-counts", text: `${c.completed} completed, ${c.failed} failed of ${c.total} requests; ` +
      `jobs: ${p.running} running, ${p.queued} queued` + (p.eta_s ? `, about ${Math.round(p.eta_s)} s left` : "") }),
    el("p", {}, files.length ? files : el("span", { class: "muted", text: "output files appear when the batch ends" })),
    table(["line", "custom_id", "status", "job", "progress"], rows),
    snap.rows_shown < snap.rows_total ? el("p", { class: "muted", text: `first ${snap.rows_shown} of ${snap.rows_total} lines` }) : null);
  for (const a of main.querySelectorAll("a.file-link")) {
    a.onclick = async (e) => {
      e.preventDefault();
      const blob = new Blob([await api(`/v1/files/${a.dataset.file}/content`, true)], { type: "application/jsonl" });
      window.open(URL.createObjectURL(blob));
    };
  }
}

// ---- job view ----

function segmentNode(s) {
  const cls = ["seg", s.kind, ...s.marks];
  if (s.text === null) {
    cls.push("gap");
    return el("span", { class: cls.join(" "), "data-start": s.start, "data-end": s.end,
                        text: `[… ${s.end - s.start} tokens ${s.kind} …]` });
  }
  return el("span", { class: cls.join(" "), "data-start": s.start, "data-end": s.end,
                      title: `${s.kind} tokens [${s.start}, ${s.end})${s.marks.length ? " — " + s.marks.join(", ") : ""}`,
                      text: s.text });
}

function strip(view) {
  const total = view.result.total || 1;
  return el("div", { id: "job-strip", title: "token positions: restored, protected prefix, kept, tail, healed, dropped" },
    view.bands.map((b) => el("div", { class: b.kind, "data-start": b.start, "data-end": b.end,
                                      title: `${b.kind} tokens [${b.start}, ${b.end})`,
                                      style: `width:${(100 * (b.end - b.start) / total).toFixed(3)}%` })));
}

// What the target did with a generate job's prompt (result.target_tokens) and its heal job.
function targetTokens(r) {
  const t = r.target_tokens || {}, n = (k) => t[k] || 0;
  return el("span", { id: "target-tokens", "data-restored": n("restored"), "data-healed": n("healed"),
    "data-full": n("prefilled_full"), "data-sparse": n("prefilled_sparse"),
    text: `${n("restored")} restored (${n("healed")} of them healed), ${n("prefilled_full")} prefilled in full, ` +
          `${n("prefilled_sparse")} prefilled sparse` });
}
function healState(r) {
  const h = r.heal || {};
  if (h.queued) return el("span", { id: "heal-state", "data-queued": "true" }, "queued: ", jobLink(h.job_id), ` (${h.tokens} tokens)`);
  return el("span", { id: "heal-state", "data-queued": "false", text: h.reason || "—" });
}

function healSummary(view) {
  const r = view.result, o = view.options;
  const items = [["status", status(view.status)], ["kind", "heal (tokens)"],
    ["heals", el("span", { id: "heal-tokens", "data-tokens": o.tokens },
      `${o.tokens} tokens of `, o.source_job ? jobLink(o.source_job) : "a job", o.resume ? `, from token ${o.resume}` : "")],
    ["target model", o.target_model], ["worker", view.worker || ""]];
  if (o.note) items.push(["stops short", o.note]);
  if (r) {
    items.push(["stored", el("span", { id: "heal-result", "data-healed": r.healed, "data-restored": r.restored },
      `${r.restored} restored, ${r.healed} healed, stored to ${r.stored}` + (r.reason ? ` (${r.reason})` : ""))]);
    if (r.yielded) items.push(["yielded", el("span", {}, (r.yielded_for || "to a user job") + "; continues in ", jobLink(r.continuation))]);
  }
  return el("dl", { class: "summary" }, items.map(([k, v]) => [el("dt", { text: k }), el("dd", {}, v)]));
}

function summary(view) {
  if (view.kind === "heal") return healSummary(view);
  const r = view.result, o = view.options;
  const pc = (x) => (100 * x).toFixed(1) + "%";
  const items = [["status", status(view.status)], ["kind", view.kind + " (" + view.input_kind + ")"],
    ["kept", r ? `${r.kept} of ${r.total} tokens; ${pc(r.ratio)} of the ${r.total - r.restored} tokens selected over` : ""],
    ["reason", r && (r.keep_effect || r.reason) ? (r.keep_effect || r.reason) : "—"]];
  if (r && view.kind === "generate") {
    items.push(["target, from the block store", el("span", { id: "restored-tokens", "data-tokens": r.restored,
      text: `${r.restored} tokens restored (${pc(r.restored_ratio)} of the prompt)` })],
      ["target tokens", targetTokens(r)], ["heal", healState(r)]);
  }
  items.push(["draft, from the block store", r ? `${r.cached_tokens} tokens` + (r.memo_hit ? " (memo hit)" : "") : ""],
    ["options", el("span", { id: "job-options", text: `keep ${o.keep}, chunk ${o.chunk_size}` +
      (o.follow_chunks ? `, follow ${o.follow_chunks}` : "") + `, tail ${o.tail_tokens}, threshold ${o.threshold}` })],
    ["draft model", o.draft_model], ["worker", view.worker || ""]);
  if (r && r.ttft_s !== undefined) items.push(["TTFT", r.ttft_s.toFixed(3) + " s"], ["target model", o.target_model]);
  return el("dl", { class: "summary" }, items.map(([k, v]) => [el("dt", { text: k }), el("dd", {}, v)]));
}

async function renderJob(id) {
  const view = await api("/api/jobs/" + encodeURIComponent(id));
  const parts = [el("h2", {}, "Job ", el("span", { class: "mono", text: view.job_id })), summary(view)];
  if (view.status !== "finished") {
    const line = el("p", { id: "job-progress", text: "waiting for events…" });
    show(...parts, line);
    await follow(`/api/jobs/${encodeURIComponent(id)}/events`, (ev) => {
      const [phase, fraction] = eventProgress(ev);
      line.textContent = `${ev.kind}${phase && phase !== ev.kind ? " — " + phase : ""} ${fraction ? fraction.toFixed(0) + "%" : ""}`;
    });
    return renderJob(id);
  }
  if (view.kind === "heal") return show(...parts);  // a heal has no answer, selection or curve
  const ex = view.explain || {};
  if (view.result.text !== undefined) parts.push(el("h2", { text: "Answer" }), el("div", { class: "answer", text: view.result.text }));
  parts.push(el("h2", { text: "What SpecPrefill kept" }),
    el("p", { class: "legend" }, el("span", { class: "seg kept", text: "kept chunk" }),
       el("span", { class: "seg kept restored", text: "holds tokens restored from the block store" }),
       el("span", { class: "seg kept prefix", text: "holds the protected prefix" }),
       el("span", { class: "seg kept tail", text: "holds the tail" }), el("span", { class: "seg dropped", text: "dropped" }),
       el("span", { class: "seg dropped healed", text: "healed later" }),
       el("span", { class: "muted", text: "(the strip and the curve mark their exact token positions)" })),
    strip(view));
  if (!ex.text) {
    parts.push(el("p", { class: "note", text: "this result keeps no kept text (more tokens kept than the page keeps " +
      "text for), so segments show their token counts only" }));
  } else if (!view.aligned) {
    parts.push(el("p", { class: "note", text: "the kept spans could not each be placed in the document exactly once, " +
      "so dropped text is shown by its token count only" }));
  }
  parts.push(el("div", { id: "job-doc" }, view.segments.map(segmentNode)));
  const curve = el("div", { id: "job-curve" });
  parts.push(el("h2", { text: "Importance over token positions" }), curve);
  show(...parts);
  if (view.importance) {
    curve.innerHTML = await api(`/api/jobs/${encodeURIComponent(id)}/importance.svg`, true);  // our own SVG
  } else {
    curve.replaceChildren(el("p", { class: "muted", id: "no-curve", text: ex.note || "no importance for this job" }));
  }
}

// ---- routing ----

async function route() {
  if (current) current.abort();
  current = new AbortController();
  const [, view, id] = (location.hash || "#/").split("/");
  try {
    if (view === "batch" && id) {
      renderBatch(await api("/api/batches/" + encodeURIComponent(id)));
      await follow(`/api/batches/${encodeURIComponent(id)}/events`, renderBatch);
    } else if (view === "job" && id) {
      await renderJob(decodeURIComponent(id));
    } else {
      renderOverview(await api("/api/overview"));
      await follow("/api/overview/events", renderOverview);
    }
  } catch (e) {
    if (e.name !== "AbortError") show(el("p", { class: "note", text: "error: " + e.message }));
  }
}

window.addEventListener("hashchange", route);
route();
