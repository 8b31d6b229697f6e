"""The benchmark's report: results of bench/measure.py's figures as min / median / max tables.

summarize pairs the sides per repeat (ours vs plain, floor vs plain); render_table prints the
main table with every error, crash and disturbance noted; render_extras the scaling curve,
pool availability, open streams and the bare grpc.aio floor.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench import curve, pool
from bench.measure import ERROR_KEYS, SIDES, Params, figures, lat_rate


def mmm(xs: list[float]) -> list[float] | None:
    return [min(xs), statistics.median(xs), max(xs)] if xs else None


def fmt3(v: list[float] | None, spec: str, signed: bool = False) -> str:
    if v is None:
        return "n/a"
    f = "{:+" + spec + "}" if signed else "{:" + spec + "}"
    return " / ".join(f.format(x) for x in v)


Row = tuple[str, str, tuple[str, ...], str, str]


def table_rows(p: Params) -> list[Row]:
    """label, figure, path inside the figure, format, comparison"""
    out: list[Row] = [("delivered chunks/s at saturation", "saturation", ("chunks_per_s",), ".0f",
            "ratio")]
    for d in p.lat_delays_ms:
        f = f"latency@{lat_rate(p, d)}"
        out += [
            (f"per-chunk latency p50 (ms) @{lat_rate(p, d)}/s", f, ("p50_ms",), ".3f", "delta"),
            (f"per-chunk latency p99 (ms) @{lat_rate(p, d)}/s", f, ("p99_ms",), ".3f", "delta"),
            ("  achieved rate (chunks/s)", f, ("achieved_chunks_per_s",), ".0f", "ratio"),
            ("  processor CPU (cores)", f, ("cpu_cores", "processor"), ".2f", "ours"),
        ]
    return out + ROWS


ROWS: list[Row] = [
    ("time to first delta p50 (ms)", "ttfd", ("p50_ms",), ".3f", "delta"),
    ("time to first delta p99 (ms)", "ttfd", ("p99_ms",), ".3f", "delta"),
    ("etcd round trips per request", "ttfd", ("etcd", "round_trips_per_request"), ".2f",
     "ours"),
    ("failover: TTFD beyond survivor p50 (ms)", "failover", ("beyond_p50_ms",), ".1f", "ours"),
    ("failover: TTFD beyond survivor max (ms)", "failover", ("beyond_max_ms",), ".1f", "ours"),
    ("  failover: survivor's own TTFD p50 (ms)", "failover", ("normal_p50_ms",), ".1f", "ours"),
    ("  failover: TTFD with failover p50 (ms)", "failover", ("failover_p50_ms",), ".1f",
     "ours"),
    ("processor CPU us/chunk (saturation)", "saturation", ("cpu_us_per_chunk", "processor"),
     ".1f", "ours"),
    ("etcd CPU us/chunk (saturation)", "saturation", ("cpu_us_per_chunk", "etcd"), ".1f",
     "ours"),
    ("envoy CPU us/chunk (saturation)", "saturation", ("cpu_us_per_chunk", "envoy"), ".1f",
     "delta"),
    ("replicas CPU us/chunk (saturation)", "saturation", ("cpu_us_per_chunk", "replicas"),
     ".1f", "delta"),
    ("client CPU us/chunk (saturation)", "saturation", ("cpu_us_per_chunk", "client"), ".1f",
     "delta"),
    ("processor CPU (cores) (saturation)", "saturation", ("cpu_cores", "processor"), ".2f",
     "ours"),
    ("ext_proc msgs per content event (sat.)", "saturation",
     ("extproc_msgs_per_content_event",), ".2f", "ours"),
    ("machine busy, both cores (saturation)", "saturation", ("cpu_s", "machine_busy_frac"),
     ".2f", "delta"),
    ("  hypervisor steal (saturation)", "saturation", ("cpu_s", "steal_frac"), ".3f", "delta"),
    ("  unaccounted CPU, cores (saturation)", "saturation", ("cpu_cores", "unaccounted"),
     ".2f", "delta"),
]


def _get(r: dict[str, Any], fig: str, path: tuple[str, ...]) -> float | None:
    f = r.get(fig)
    if f is None:
        return None  # a figure this side does not measure (failover on the floor)
    if not f.get("valid", True):
        return None
    v: Any = f
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None  # a figure this side does not have (e.g. failover on plain)
        v = v[k]
    return float(v)


def summarize(runs: list[dict[str, Any]], p: Params) -> dict[str, Any]:
    by: dict[str, dict[int, dict[str, Any]]] = {s: {} for s in SIDES}
    for r in runs:
        by[r["side"]][r["repeat"]] = r
    reps = sorted(set(by["plain"]) & set(by["ours"]) & set(by["floor"]))
    rows = []

    def paired(side: str, fig: str, path: tuple[str, ...], op: str) -> list[float]:
        rel = []
        for rep in reps:
            a, b = _get(by["plain"][rep], fig, path), _get(by[side][rep], fig, path)
            if a is not None and b is not None and op in ("ratio", "delta"):
                rel.append(b / a if op == "ratio" else b - a)
        return rel

    for label, fig, path, spec, op in table_rows(p):
        vals = {s: [v for rep in reps if (v := _get(by[s][rep], fig, path)) is not None]
                for s in SIDES}
        rows.append({"figure": label, "spec": spec, "op": op,
                     "plain": None if op == "ours" else mmm(vals["plain"]),
                     "ours": mmm(vals["ours"]), "floor": mmm(vals["floor"]),
                     "vs": mmm(paired("ours", fig, path, op)) if op != "ours" else None,
                     "floor_vs": mmm(paired("floor", fig, path, op)) if op != "ours" else None,
                     "n": {s: len(vals[s]) for s in ("plain", "ours")}})
    errors: dict[str, dict[str, int]] = {}
    for side in SIDES:
        e = {k: 0 for k in (*ERROR_KEYS, "crashes")}
        for r in by[side].values():
            for fig in figures(p, side):
                for k in e:
                    e[k] += int(r[fig][k])
        errors[side] = e
    return {"rows": rows, "errors": errors, "repeats": len(reps)}


def render_table(meta: dict[str, Any], p: Params, summary: dict[str, Any],
                 runs: list[dict[str, Any]]) -> str:
    lines = [
        f"extproc benchmark  {meta['date_utc']}",
        f"machine: {meta['nproc']} CPUs, {meta['cpu_model']}, kernel {meta['kernel']}; "
        f"Envoy {meta['envoy']}; Python {meta['python']}; extproc sources sha256 "
        f"{meta['code_sha256_start']}"
        + ("" if meta["code_sha256_end"] == meta["code_sha256_start"] else
           f" -> {meta['code_sha256_end']} (WARNING: the code changed during the run)"),
        f"repeats={p.repeats}; saturation: C={p.sat_clients} streams x {p.sat_tokens} tokens, "
        f"no delay, {p.sat_duration_s:g} s window; latency: {p.lat_streams} streams x "
        f"{p.lat_tokens} tokens @ "
        + " and ".join(f"{d:g} ms/token (offered {lat_rate(p, d)} chunks/s)"
                       for d in p.lat_delays_ms)
        + f", {p.lat_duration_s:g} s windows; TTFD: {p.ttfd_requests} sequential x "
        f"{p.ttfd_tokens} tokens",
        "cells: min / median / max over repeats; 'ours vs plain' is computed per repeat "
        "(paired back-to-back runs), then min / median / max",
        "floor: the same Envoy config and ext_proc messages answered by bench/nullproc.py "
        "(no logic, no etcd): the cheapest any processor of this design on grpc.aio can be",
        "",
    ]
    w0, w1, w2 = 38, 26, 28
    lines.append(f"{'figure':<{w0}} {'plain':<{w1}} {'ours':<{w1}} {'ours vs plain':<{w2}} "
                 "floor vs plain")
    lines.append("-" * (w0 + 2 * w1 + 2 * w2 + 4))
    for r in summary["rows"]:
        spec, op = r["spec"], r["op"]
        plain = "-" if op == "ours" else fmt3(r["plain"], spec)
        ours = fmt3(r["ours"], spec)
        if op == "ratio":
            vs, fvs = "x " + fmt3(r["vs"], ".3f"), "x " + fmt3(r["floor_vs"], ".3f")
        elif op == "delta":
            vs, fvs = fmt3(r["vs"], spec, signed=True), fmt3(r["floor_vs"], spec, signed=True)
        else:
            vs = fvs = ""
        if op == "ours" and r["floor"] is not None:
            fvs = "floor " + fmt3(r["floor"], spec)  # the null processor's own figure
        elif r["floor_vs"] is None:
            fvs = ""
        short = [s for s in ("plain", "ours") if r["n"][s] < summary["repeats"]
                 and not (op == "ours" and s == "plain")]
        if short:
            fvs += "  (valid runs: " + ", ".join(f"{s} {r['n'][s]}/{summary['repeats']}"
                                                  for s in short) + ")"
        lines.append(f"{r['figure']:<{w0}} {plain:<{w1}} {ours:<{w1}} {vs:<{w2}} {fvs}"
                     .rstrip())
    lines.append("")
    for side in SIDES:
        e = summary["errors"][side]
        lines.append(f"errors {side:<5}: requests={e['requests']} ok={e['ok']} "
                     f"non_200={e['non_200']} transport={e['transport_errors']} "
                     f"error_events={e['error_events']} incomplete={e['incomplete']} "
                     f"stack_crashes={e['crashes']}")
    started = resets = 0
    for r in runs:
        for fig in figures(p, r["side"]):
            c = r[fig]["envoy_counters"]
            started += sum(v for k, v in c.items() if k.endswith("ext_proc.streams_started"))
            resets += c.get("cluster.extproc.upstream_rq_tx_reset", 0)
    if started:
        lines.append(f"info ours: Envoy reset {resets} of {started} ext_proc gRPC streams it "
                     "started (expected: Envoy's ext_proc client ends every side stream with "
                     "closeStream()+resetStream(); not a client-visible error)")
    for r in runs:
        notes = []
        for fig in figures(p, r["side"]):
            f = r[fig]
            for a in f["attempts"]:
                if a["died"]:
                    notes.append(f"{fig}: {'+'.join(a['died'])} died after "
                                 f"{a['died_after_s']} s ({a['workdir']})")
            if f["non_200_statuses"]:
                notes.append(f"{fig} statuses {f['non_200_statuses']}")
            if f["transport_samples"]:
                notes.append(f"{fig} transport e.g. {f['transport_samples'][0]!r}")
            if f.get("budget_exhausted"):
                notes.append(f"{fig}: request budget exhausted before the window ended")
            if f["idle_check"]["busy_before"] > p.idle_threshold:
                notes.append(f"{fig}: machine still {f['idle_check']['busy_before']:.0%} busy "
                             f"with other load after waiting {f['idle_check']['waited_s']} s")
            for a in f["attempts"]:
                if a["disturbed"] and not a["died"]:
                    notes.append(f"{fig}: other processes used > {p.other_load_limit:g} cores "
                                 f"during an attempt ({a['workdir']})"
                                 + (" - its numbers are the ones shown" if a["workdir"] ==
                                    f["workdir"] else " - measured again"))
            levels = {lv: n for lv, n in f["processor_log_levels"].items()
                      if lv not in ("INFO", "DEBUG")}
            if levels:
                notes.append(f"{fig} processor log {levels}")
            bad = {k: v for k, v in f["envoy_counters"].items()
                   if any(s in k for s in ("5xx", "retry", "reset", "failed", "timeout",
                                           "overflow", "error"))
                   and "per_try" not in k and not k.endswith("_limit")
                   and not k.startswith("cluster.extproc.")}  # see docs: expected resets
            if bad:
                notes.append(f"{fig} envoy {bad}")
        for n in notes:
            lines.append(f"  repeat {r['repeat']} {r['side']}: {n}")
    return "\n".join(lines)


def render_extras(x: dict[str, Any]) -> str:
    lines = [curve.table(x["curve"]["rows"]), f"(plot: {x['curve']['png']})", ""]
    if x.get("pool"):
        lines += [pool.table(x["pool"]), ""]
    st = x["streams"]
    lines.append("open streams held by one processor process (driven directly over ext_proc; "
                 f"baseline RSS {st['baseline_rss_kib'] / 1024:.1f} MiB):")
    prev: dict[str, Any] | None = None
    for pt in st["points"]:
        marginal = ("" if prev is None else "   marginal {:6.2f} KiB/stream".format(
            (pt["rss_kib"] - prev["rss_kib"]) / max(1, pt["open_ok"] - prev["open_ok"])))
        lines.append(f"  {pt['open_ok']:>6}/{pt['streams']:<6} open   RSS "
                     f"{pt['rss_kib'] / 1024:7.1f} MiB   {pt['kib_per_stream']:6.2f} KiB/stream"
                     + marginal)
        prev = pt
    lg = st.get("long")
    if lg:
        lines.append(f"  then {lg['went_on']} of them {lg['tokens_each']} token messages further "
                     f"on: +{lg['extra_kib_per_stream']:.2f} KiB per stream (the process's "
                     "growth over them: their traces, bounded by telemetry.max_trace_bytes, "
                     "and delivery marks; the other open streams' checkpoint records "
                     "meanwhile)")
    f = x["floor"]
    lines += ["", "floor: bare grpc.aio ext_proc server (no processor logic), same machine:",
              f"  one stream ping-pong: {f['pingpong']['msgs_per_s']:.0f} msgs/s, "
              f"{f['pingpong']['server_cpu_us_per_msg']:.1f} us server CPU per message",
              f"  64 concurrent streams: {f['concurrent64']['msgs_per_s']:.0f} msgs/s, "
              f"{f['concurrent64']['server_cpu_us_per_msg']:.1f} us server CPU per message "
              f"({f['concurrent64']['server_cores']:.2f} cores)",
              f"  {f['idle_streams']['streams']} open streams after 5 messages each: "
              f"{f['idle_streams']['kib_per_stream']:.2f} KiB per stream on average, "
              f"{f['idle_streams']['kib_per_stream_marginal']:.2f} KiB per stream from "
              f"{f['idle_streams']['streams'] // 2} to {f['idle_streams']['streams']}"]
    return "\n".join(lines)
