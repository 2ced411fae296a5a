"""The human tables of ``accel-graph demo``: a :func:`~accel_graph.cli.demo.run_demo` report as
text (buckets, serving, batch-1 and multi-step decoding, runner overhead, the token verdict).

Contract: :func:`format_report` reads only the report dict; it measures nothing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["format_report"]


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_report(report: dict[str, Any]) -> str:
    """The human-readable tables of a :func:`run_demo` report."""
    hw, st, sv = report["hardware"], report["settings"], report["serving"]
    mib = 1 / 2**20
    lines = [
        f"accel-graph demo: {report['model']['name']} ({report['model']['parameters']:,} "
        f"parameters), buckets {st['buckets']}, replay "
        f"{'compiled (inductor)' if st['compile'] else 'as captured'}",
        f"cpu: {hw['cpu']} | nproc {hw['nproc']} | torch {hw['torch']} | threads {hw['threads']}",
        "",
        f"{'bucket':>6} {'capture ms':>10} {'MiB incr':>9} {'MiB alone':>9} "
        f"{'replay us':>10} {'eager us':>9} {'speedup':>8}  note",
    ]
    for row in report["buckets"]:
        note = "" if row["status"] == "captured" else f"{row['status']}: {row['reason']}"
        if row.get("compile_fallback"):
            note += f"compile fell back: {row['compile_fallback']}"
        inc, alone = row["incremental_bytes"], row["standalone_bytes"]
        lines.append(
            f"{row['bucket']:>6} {_f(row['capture_ms'], '.0f'):>10} "
            f"{_f(None if inc is None else inc * mib, '.2f'):>9} "
            f"{_f(None if alone is None else alone * mib, '.2f'):>9} "
            f"{_f(row['graph_step_us'], '.1f'):>10} {_f(row['eager_step_us'], '.1f'):>9} "
            f"{_f(row['speedup'], '.2f'):>7}x  {note}")
    pool = report["pool_reserved_bytes"]
    lines += [
        f"pool: {_f(None if pool is None else pool * mib, '.2f')} MiB reserved; capture "
        f"(with compile) {report['capture_s']:.1f} s",
        "",
        f"served {sv['requests']} requests (batch sizes {sv['batch_sizes']}), "
        f"{sv['generated_tokens']} tokens each way:",
        f"  eager {_f(sv['eager_tokens_per_s'], '.0f')} tokens/s | graph "
        f"{_f(sv['graph_tokens_per_s'], '.0f')} tokens/s | speedup {_f(sv['speedup'], '.2f')}x",
    ]
    b1 = report.get("batch1")
    if b1:
        lines.append(
            f"  batch 1 alone ({b1['new_tokens']} tokens, median of {b1['rounds']} interleaved "
            f"generations): eager {b1['eager_tokens_per_s']:.0f} tokens/s | graph "
            f"{b1['graph_tokens_per_s']:.0f} tokens/s | speedup {b1['speedup']:.2f}x")
    ms = report.get("multistep")
    if ms:
        lines.append(
            f"  multi-step decode (batch 1, {ms['new_tokens']} tokens in one "
            f"{'compiled' if st['compile'] else 'interpreted'} replay of a torch.while_loop graph"
            f"{', body and predicate compiled, loop on the host' if st['compile'] else ''}): "
            f"{ms['multi_step_tokens_per_s']:.0f} tokens/s vs "
            f"{ms['one_step_tokens_per_s']:.0f} one step per replay"
            f"{' (compiled)' if st['compile'] else ''} ({ms['multi_vs_one_step']:.2f}x); "
            f"tokens equal to eager: {'yes' if ms['tokens_equal_eager'] else 'NO'}")
    ov = report["overhead"]
    if ov:
        line = (f"runner overhead per call at batch 1 (median runner call - median bare replay): "
                f"{ov['tiny_overhead_us']:.1f} us on a tiny step ({ov['tiny_runner_us']:.1f} - "
                f"{ov['tiny_bare_replay_us']:.1f})")
        if "decoder_overhead_us" in ov:
            line += (f"; {ov['decoder_overhead_us']:.1f} us on the decoder's graph "
                     f"({ov['decoder_runner_us']:.1f} - {ov['decoder_bare_replay_us']:.1f}; "
                     f"within that replay's own run-to-run noise)")
        lines.append(line)
    ck = report["check"]
    verdict = "OK" if ck["ok"] else "FAILED"
    lines.append(
        f"greedy tokens, graph vs eager: {verdict}: {sv['tokens_compared']} compared, "
        f"{ck['near_ties']} near-tie differences (eager's top-2 logits within fp32 tolerance), "
        f"{ck['mismatches']} other differences")
    for m in sv["mismatches"][:5]:
        lines.append(f"  request {m['request']} row {m['row']} position {m['position']}: eager "
                     f"{m['eager']} vs graph {m['graph']} (top-2 gap {m['top2_gap']:.3g})")
    lines.append(f"wall time {report['wall_s']:.1f} s")
    return "\n".join(lines) + "\n"
