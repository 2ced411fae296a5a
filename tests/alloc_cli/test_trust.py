"""Issue 16: figures a user can trust on real-shaped traces -- allocation sites on torch-shaped
frames, the requested bytes of pre-existing blocks, the recording's own peak beside the
whole-trace peak, the rebuilt start state, recommendations, and the small CLI items."""

from __future__ import annotations

import pickle

import pytest

from accel_graph.allocator.analysis.inspect import inspect_trace
from accel_graph.allocator.analysis.sites import FRAME_RULE, top_user_frame, user_chain
from accel_graph.allocator.sim.profiles import resolve_profile
from accel_graph.allocator.sim.replayer import replay_trace
from accel_graph.allocator.sim.torch_shaped import USER_FILE, torch_frames, warm_start_trace
from accel_graph.allocator.sim.trace_ops import recorded_summary
from accel_graph.allocator.traces import save_trace
from accel_graph.allocator.tune.ranking import Candidate, rank
from accel_graph.allocator.tune.recommend import WARNING_FREE_SLACK
from accel_graph.allocator.tune.recommend import prefer_warning_free as _prefer_warning_free
from accel_graph.allocator.tune.versions import infer_torch, knob_requirements, version_warnings
from accel_graph.cli.alloc import options

MIB = 1 << 20


@pytest.fixture(scope="module")
def warm():
    return warm_start_trace(steps=6)


@pytest.fixture(scope="module")
def warm_path(warm, tmp_path_factory):
    path = tmp_path_factory.mktemp("warm") / "warm.pickle"
    save_trace(warm, path)
    return path


# ------------------------------------------------------------------------------------------
# 1. allocation sites


def test_first_user_frame_skips_cpp_torch_and_stdlib_frames():
    frames = torch_frames(42, "forward")
    assert frames[0]["filename"] == "??"  # C++ first, as torch records them
    top = top_user_frame(frames)
    assert (top["filename"], top["line"], top["name"]) == (USER_FILE, 42, "forward")
    assert [f["line"] for f in user_chain(frames)] == [42, 200]
    # only C++ and torch frames: the first Python frame, never '??'
    only = [frames[0], frames[3], frames[4]]
    assert top_user_frame(only) is frames[3]
    assert top_user_frame([frames[0], {"filename": "libtorch_cuda.so", "name": "x"}])[
        "filename"] == "libtorch_cuda.so"
    # site-packages below lib/pythonX.Y is not the standard library
    hf = {"filename": "/v/lib/python3.11/site-packages/transformers/trainer.py", "line": 9}
    assert top_user_frame([frames[5], hf]) is hf


def test_inspect_attributes_sites_to_user_frames(warm):
    r = inspect_trace(warm, top=10)
    labels = [s["site"] for s in r["sites_over_run"]]
    assert not any(lab.startswith("??") for lab in labels)
    assert labels[0] == f"{USER_FILE}:42 (forward)"  # the largest bytes over the run
    over = r["sites_over_run"]
    assert [s["allocated_bytes"] for s in over] == sorted((s["allocated_bytes"] for s in over),
                                                          reverse=True)
    total = int(warm.events(0)["size"][warm.events(0)["action"] == 0].sum())
    assert sum(s["allocated_bytes"] for s in over) == total
    assert r["sites_rule"] == FRAME_RULE
    assert all(" <- " in s["stack"] for s in r["stacks"] if s["stack"].startswith("/"))
    # the whole-trace peak is the inherited start state: the recording's own peak names sites
    assert r["at_peak"]["state"] == 0 and r["peaks"]["reserved_is_start_state"]
    rec = r["at_recording_peak"]
    live = {s["site"]: s["live_at_peak_bytes"] for s in rec["sites"]}
    assert live["(allocated before the recording began)"] == 6 * 20_000_000
    assert sum(live.values()) == rec["requested"]


def test_inspect_text_names_the_rule_and_no_event_minus_one(cli, warm_path):
    r = cli("inspect", warm_path)
    assert r.code == 0, r.err
    assert "after event -1" not in r.out
    assert "at the start of the recording" in r.out
    assert "frame rule:" in r.out and "over the whole run" in r.out
    assert "by user call stack" in r.out and "recording's own peak" in r.out


# ------------------------------------------------------------------------------------------
# 2. requested bytes of pre-existing blocks


def test_pre_existing_blocks_count_their_recorded_requested_size(warm):
    r = replay_trace(warm, keep_events=True)
    # six 20 MiB blocks asked for 20,000,000 bytes each: the slack is not requested bytes
    assert r.start_stats["requested_bytes.all.current"] == 6 * 20_000_000
    assert r.start_stats["allocated_bytes.all.current"] == 6 * 20 * MIB
    insp = inspect_trace(warm)
    assert insp["start"]["requested"] == 6 * 20_000_000
    assert r.peak_requested == insp["peaks"]["requested"]  # the replay agrees with the walk


# ------------------------------------------------------------------------------------------
# 3. the recording's own peak


def test_recording_peak_beside_whole_trace_peak(warm, cli, warm_path):
    rec = recorded_summary(warm)
    assert rec["peak_reserved"] == rec["start_reserved"]  # the start state is the peak
    assert rec["peak_reserved_recording"] < rec["peak_reserved"]
    assert inspect_trace(warm)["peaks"]["reserved_in_recording"] == rec["peak_reserved_recording"]
    v = cli("validate", warm_path, "--json").json()
    m = v["metrics"]["peak_reserved_recording"]
    assert m["recorded"] == rec["peak_reserved_recording"] and m["error"] == 0 and v["exact"]
    # a setting changes the recording's peak while the whole-trace peak stays the start state
    s = cli("simulate", warm_path, "--config", "roundup_power2_divisions:4", "--json").json()
    assert s["predicted"]["peak_reserved"] == rec["peak_reserved"]
    assert s["effects"]["on_recording_peak"] != 0
    assert s["effects"]["on_whole_trace_peak"] == 0


def test_tune_ranks_on_the_chosen_peak(cli, warm_path):
    by_rec = cli("tune", warm_path, "--json", "--no-progress", "--budget", "48").json()
    by_all = cli("tune", warm_path, "--json", "--no-progress", "--budget", "48",
                 "--peak", "trace").json()
    assert (by_rec["peak_scope"], by_all["peak_scope"]) == ("recording", "trace")
    ok = [r for r in by_rec["ranked"] if not r["oom"]]
    assert by_rec["ranked"][0]["peak_reserved_recording"] == min(
        r["peak_reserved_recording"] for r in ok)
    ok = [r for r in by_all["ranked"] if not r["oom"]]
    assert by_all["ranked"][0]["peak_reserved"] == min(r["peak_reserved"] for r in ok)
    text = cli("tune", warm_path, "--no-progress", "--budget", "48").out
    assert "is not the recording's own" in text


# ------------------------------------------------------------------------------------------
# 4. counterfactual start states


def test_rebuilt_start_state_is_shown_and_separated(cli, warm_path):
    s = cli("simulate", warm_path, "--config", "expandable_segments:True", "--json").json()
    st, e = s["start_state"], s["effects"]
    assert st["recorded"] == s["recorded"]["start_reserved"]
    assert st["rebuilt"] == s["predicted"]["start_reserved"]
    assert st["rebuilt_minus_recorded"] == st["rebuilt"] - st["recorded"] != 0
    assert e["on_start_state"] == st["rebuilt"] - e["baseline_start_reserved"]
    assert e["on_recording_peak"] == (s["predicted"]["peak_reserved_recording"]
                                      - e["baseline_peak_reserved_recording"])
    text = cli("simulate", warm_path, "--config", "expandable_segments:True").out
    assert "start state: recorded" in text and "on the recording's own peak" in text
    # the recorded settings: no effect to separate
    assert cli("simulate", warm_path, "--json").json()["effects"] is None


# ------------------------------------------------------------------------------------------
# 5. recommendations


def _cand(config: str, peak: int, calls: int = 10) -> Candidate:
    return Candidate(config=config, policy="native", stage="t", peak_reserved=peak,
                     peak_allocated=0, device_mallocs=calls, device_frees=0, maps=0, unmaps=0,
                     retries=0, ooms=0, fragmentation_at_peak=0.0,
                     peak_reserved_recording=peak, start_reserved=0)


def test_a_warning_free_config_within_the_slack_is_recommended():
    prof = resolve_profile("cuda-2.13")
    flagged = _cand("max_split_size_mb:128,expandable_segments:True", 10_000 * MIB)
    close = _cand("max_split_size_mb:32", int(10_000 * MIB * 1.0002))  # +0.02 %
    ranked = rank([close, flagged], "peak")
    assert ranked[0] is flagged
    rec, passed = _prefer_warning_free(ranked, "recording", prof, "cuda", (), False)
    assert rec is close and passed["codes"] == ["max-split-with-es"]
    assert passed["peak_difference"] == close.peak_reserved - flagged.peak_reserved
    far = _cand("max_split_size_mb:32", int(10_000 * MIB * (1 + 3 * WARNING_FREE_SLACK)))
    rec, passed = _prefer_warning_free(rank([far, flagged], "peak"), "recording", prof, "cuda",
                                       (), False)
    assert rec is flagged and passed is None
    # on cuda-2.9 the pair is only a 'warning' (no growth there): the best one stays
    rec, _ = _prefer_warning_free(ranked, "recording", resolve_profile("cuda-2.9"), "cuda",
                                  (), False)
    assert rec is flagged


def test_best_without_expandable_segments_follows_the_objective(cli, frag_trace):
    p = cli("tune", frag_trace, "--json", "--no-progress", "--objective", "mallocs").json()
    alt = p["recommendation"]["best_without_expandable_segments"]
    if alt is None:
        pytest.skip("the recommendation has no expandable segments")
    no_es = [r for r in p["ranked"] + p["pareto"] + [p["baseline"]]
             if r["config"] is not None and "expandable_segments:True" not in r["config"]]
    low = min(r["peak_reserved_recording"] for r in no_es + [alt])
    assert alt["peak_reserved_recording"] <= low * 1.05  # within the mallocs slack of its own set


def test_torch_version_assumed_and_inferred(cli, warm_path, warm):
    p = cli("tune", warm_path, "--json", "--no-progress", "--budget", "24").json()
    t = p["recommendation"]["torch"]
    assert t["profile"] == "cuda-2.14" and t["assumed"] == "2.14 or later"
    assert t["trace"]["at_least"] is None  # the recorded config string is empty
    assert infer_torch(warm_start_trace(steps=1, settings="expandable_segments:True"))[
        "at_least"] == "2.1"
    newer = warm_start_trace(steps=1, settings="large_segment_size_mb:64")
    newer.allocator_settings["PYTORCH_CUDA_ALLOC_CONF"] = "large_segment_size_mb:64"
    # torch 2.11.0 already accepts large_segment_size_mb (measured: its frozen parity table)
    assert infer_torch(newer)["at_least"] == "2.11"
    assert "cuda-2.11" in infer_torch(newer)["evidence"][0]
    py313 = warm_start_trace(steps=1)
    py313.stacks = [tuple(dict(f, filename=str(f["filename"]).replace("python3.11", "python3.13"))
                          for f in st) for st in py313.stacks]
    seen = infer_torch(py313)
    assert seen["at_least"] == "2.5" and "Python 3.13" in seen["evidence"][0]
    prof = resolve_profile("cuda-2.13")
    assert knob_requirements("large_segment_size_mb:64,max_split_size_mb:32", prof) == {
        "large_segment_size_mb": "2.11"}
    warned = version_warnings("large_segment_size_mb:64", prof, infer_torch(warm))
    assert [w.code for w in warned] == ["knob-needs-newer-torch"]
    assert "needs torch 2.11 or later" in warned[0].message
    assert version_warnings("large_segment_size_mb:64", prof, infer_torch(newer)) == []


@pytest.mark.parametrize("key, need", [
    ("large_segment_size_mb:64", "2.11"), ("per_process_memory_fraction:0.5", "2.11"),
    ("pinned_reserve_segment_size_mb:16", "2.11"), ("graph_capture_record_stream_reuse:True", "2.11"),
    ("throw_on_cudamalloc_oom:True", "2.13"), ("pinned_free_catch_all:True", "2.13"),
    ("pinned_max_round_threshold_mb:64", "2.13"), ("pinned_max_cached_size_mb:64", "2.13"),
])  # fmt: skip
def test_knob_versions_follow_the_measured_211_parser(key: str, need: str) -> None:
    """What torch 2.11.0+cu130 accepts and refuses (tests/allocator/data/alloc_conf_torch-2.11.json)
    is what `tune` says each key needs; a trace that shows 2.11 is warned only for the 2.13 keys."""
    from accel_graph.allocator.alloc_conf import parse_config

    assert knob_requirements(key, resolve_profile("cuda-2.14")) == {key.split(":")[0]: need}
    if need == "2.11":
        parse_config(key, "cuda", "2.11")
    else:
        with pytest.raises(ValueError, match="Unrecognized key"):
            parse_config(key, "cuda", "2.11")
    shows_211 = {"at_least": "2.11", "evidence": ["test"], "exact": False}
    warned = version_warnings(key, resolve_profile("cuda-2.14"), shows_211)
    assert [w.code for w in warned] == ([] if need == "2.11" else ["knob-needs-newer-torch"])


# ------------------------------------------------------------------------------------------
# 8. small items


def test_usage_errors_are_one_line(cli, warm_path):
    r = cli("tune", warm_path, "--objective", "bogus")
    assert r.code == options.EXIT_USAGE
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("accel-alloc tune: error: ")
    r = cli("simulate", warm_path, "--cap", "0.9")
    assert r.code == options.EXIT_USAGE and len(r.err.strip().splitlines()) == 1


def test_cap_help_says_gb_means_gib(cli):
    r = cli("simulate", "--help")
    assert "GB means" in " ".join(r.out.split()) and "GiB" in r.out


def test_protocol_0_global_pickle_is_hostile(cli, tmp_path):
    path = tmp_path / "evil.pickle"
    path.write_bytes(b"cos\nsystem\n(S'echo owned'\ntR.")
    r = cli("inspect", path)
    assert r.code == options.EXIT_BAD_TRACE
    assert "global" in r.err and "os.system" in r.err and "not a memory snapshot" not in r.err
    # and protocol 0 without globals still loads as a pickle (a legacy list of segments)
    plain = tmp_path / "plain.pickle"
    plain.write_bytes(pickle.dumps([], protocol=0))
    assert cli("inspect", plain).code != options.EXIT_USAGE


def test_memory_error_message_has_text(cli, warm_path, monkeypatch):
    from accel_graph.cli.alloc import inspect as inspect_cmd

    def boom(args):
        raise MemoryError()

    monkeypatch.setattr(inspect_cmd, "run", boom)
    r = cli("inspect", warm_path)
    assert r.code == options.EXIT_INTERNAL
    assert "out of host memory" in r.err and len(r.err.strip().splitlines()) == 1


def test_nomem_status_raises_with_text():
    from accel_graph.allocator.core.loader import load_core
    from accel_graph.allocator.core.status import check_status

    with pytest.raises(MemoryError) as e:
        check_status(load_core().lib.AG_ERR_NOMEM, None, "")
    assert str(e.value)


def test_diff_gate_sees_the_recording_peak(cli, warm_path):
    # the whole-trace peak is the start state under both configs: only the recording grows
    r = cli("diff", warm_path, "--config-b", "roundup_power2_divisions:4", "--json",
            "--fail-above", "1")
    d = r.json()
    assert d["metrics"]["peak_reserved"]["delta"] == 0
    assert d["metrics"]["peak_reserved_recording"]["delta"] > 0
    assert r.code == options.EXIT_CHECK_FAILED and not d["passed"]


def test_stdlib_rule_matches_whole_python_dirs():
    user = {"filename": "/home/u/lib/python3_utils/x.py", "line": 1}
    std = {"filename": "/usr/lib64/python3.12/contextlib.py", "line": 2}
    win = {"filename": "C:/Python311/Lib/contextlib.py", "line": 3}
    assert top_user_frame([std, win, user]) is user
