"""The d2Cache family (d2c, pc/eb/certainty presets, klass, ar, wino): every case of the strategy suites of
tests/fixtures/d2cparity matches through experiments/parity.py (tokens, NFE, unmask steps, WINO's writes);
each reproduced reference quirk has an option for the corrected behaviour that changes the output; WINO's
default leaves no [MASK]; re-masks reach the trace."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import FIXTURES

D2C = FIXTURES / "d2cparity"
STRATEGY_SUITES = ["d2c_vanilla", "d2c_threshold", "d2c_factor", "d2c_pc", "d2c_eb", "d2c_klass", "d2c_wino", "d2c_ar"]


def _cases(suite):
    return json.loads((D2C / f"{suite}.json").read_text())


@pytest.mark.slow
@pytest.mark.parity
def test_every_strategy_case_matches(d2c_candidates, tmp_path):
    cands, _ = d2c_candidates
    wanted = [c["id"] for s in STRATEGY_SUITES for c in _cases(s)["cases"] if "error" not in c]
    assert len(wanted) >= 60 and all(w in cands for w in wanted), [w for w in wanted if w not in cands]
    path = tmp_path / "cand.json"
    path.write_text(json.dumps({"cases": [cands[w] for w in wanted]}))
    proc = subprocess.run([sys.executable, str(FIXTURES / "compare.py"), str(D2C), str(path),
                           "--suites", ",".join(STRATEGY_SUITES)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert f"{len(wanted)} match, 0 mismatch" in proc.stdout
    wino = [w for w in wanted if w.startswith("d2c_wino")]
    assert wino and all(cands[w]["events"] for w in wino)          # the writes were compared too


# -- quirk options ------------------------------------------------------------------------------------------
def run(parity, case_id, **overrides):
    suite = _cases(case_id.split("/")[0])
    suite.setdefault("token_freq", _cases("d2c_pc")["token_freq"])
    case = next(c for c in suite["cases"] if c["id"] == case_id)
    models = parity.model_dirs(D2C)
    name = case["model_dir"]
    model, raw, _ = parity.load_pretrained(models[name], device="cpu", dtype="float32")
    return case, parity.run_case(case, suite["prompts"], model, 1000, 1001, suite, overrides)


@pytest.mark.slow
@pytest.mark.parametrize("case_id, option", [
    ("d2c_eb/llada/vanilla/nocache/lp02/eb_gamma0.5_batch_lp02/gl32_bl8", {"eb_cummax_over_ranks": True}),    # 7
    ("d2c_vanilla/llada/vanilla/nocache/p0/t0.7/gl32_bl8_seed102", {"sample_candidates_only": True}),        # 15
    ("d2c_klass/llada/klass/nocache/p0/yaml_defaults/gl32_bl8", {"klass_commit_stable": True}),             # 5
    ("d2c_ar/llada/ar/nocache/p0/ntt1/gl32_bl8", {"ar_respect_ntt": True}),                                  # 9
    ("d2c_wino/llada/wino/nocache/p0/yaml/gl32_bl8", {"shrinking_window": False}),                           # 3/10
])
def test_corrected_behaviour_changes_the_output(parity, case_id, option):
    case, default = run(parity, case_id)
    assert default["output"] == case["output"] and default["nfe"] == case["nfe"]     # the default is the reference
    _, fixed = run(parity, case_id, **option)
    assert (fixed["output"], fixed["nfe"]) != (case["output"], case["nfe"]), option


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_restrict_to_computed_logits_keeps_uncomputed_positions_out(parity, family):
    """Quirk 1: with d2Cache computing 8 masked positions a step and 12 to commit, the reference ranks the
    uncomputed ones too (confidence 1/V from all-zero logits, token 0); the option commits only computed ones."""
    cid = f"d2c_d2cache/{family}/vanilla/d2cache/p0/k8/gl32_bl32"
    case, default = run(parity, cid)
    assert default["output"] == case["output"] and default["nfe"] == case["nfe"]
    _, ref = run(parity, cid, num_transfer_tokens=12)
    _, fixed = run(parity, cid, num_transfer_tokens=12, restrict_to_computed_logits=True)
    assert 0 in ref["output"][-32:] and 0 not in fixed["output"][-32:]
    assert fixed["nfe"] > ref["nfe"]                   # fewer than 12 valid candidates on some steps


@pytest.mark.slow
def test_wino_default_leaves_no_mask_and_the_reference_mode_does(parity):
    cid = "d2c_wino/llada/wino/nocache/p0/wide0.4_narrow0.95_single_block/gl32_bl32"
    case, ref = run(parity, cid)
    assert case["masks_left"] > 0 and ref["output"].count(1000) == case["masks_left"]
    _, fixed = run(parity, cid, shrinking_window=False)
    assert 1000 not in fixed["output"]
    steps = [s for s in fixed["unmask_step"]]
    assert all(s > 0 for s in steps)
    assert any(e[2] == 1000 for e in fixed["events"])                # it re-masked on the way


@pytest.mark.slow
def test_debias_after_alg_keeps_the_calibration(parity):
    """Quirk 8: with alg=topk_margin the reference overwrites PC-Sampler's debiased confidence (so debias has
    no effect); debias_after_alg applies it after the alg."""
    cid = "d2c_pc/llada/vanilla/nocache/p0/pc_alpha2/gl32_bl8"
    _, plain = run(parity, cid, alg="topk_margin", debias=False)
    _, ref = run(parity, cid, alg="topk_margin")
    _, fixed = run(parity, cid, alg="topk_margin", debias_after_alg=True)
    assert ref["output"] == plain["output"] and fixed["output"] != ref["output"]


@pytest.mark.slow
def test_filters_at_zero_temperature(parity):
    """Quirk 16: top-k reshapes confidences at T = 0 in the reference; the option ignores filters there."""
    cid = "d2c_vanilla/dream/vanilla/nocache/p0/ntt2/gl32_bl8"
    _, plain = run(parity, cid)
    _, ref = run(parity, cid, top_k=2)
    _, fixed = run(parity, cid, top_k=2, filters_at_zero_temperature=False)
    assert fixed["output"] == plain["output"] and ref["output"] != plain["output"]


def test_stop_until_eos_leaves_masks_unless_eos_fill():
    """Quirk 19: once a row's first decoded EOS precedes a block, the reference never decodes it (masks stay);
    eos_fill fills what follows the EOS with EOS and finishes the row."""
    from fakes import EOS, MASK, Scripted
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import strategy_class

    cls = strategy_class("d2c")
    out = {}
    for fill in (False, True):
        m = Scripted([1, EOS, 3, 4, 5, 6], [0.6, 0.99, 0.5, 0.5, 0.5, 0.5], [2, 3, 2, 2, 2, 2])
        canvas = Canvas.from_prompts([[0, 1]], 6, MASK, 0, eos_id=EOS)
        decode(m, canvas, cls(cls.Config(block_length=2, stop_until_eos=True, eos_fill=fill), 6))
        out[fill] = (canvas.tokens[0, 2:].tolist(), canvas.nfe, bool(canvas.finished[0]))
    assert out[False][0] == [1, EOS, MASK, MASK, MASK, MASK] and out[False][1] == 2 and out[False][2]
    assert out[True][0] == [1, EOS, EOS, EOS, EOS, EOS] and out[True][1] == 2 and out[True][2]


def test_wino_remasks_reach_the_trace_and_replay(tmp_path, tiny_llada):
    """Every write and re-mask of a WINO run is in the trace; a re-masked position shows as masked at the
    steps between its re-mask and its new commit, and the final tokens replay exactly."""
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import cache_class, strategy_class
    from dlm_engine.app.sinks import RecordingSink
    from dlm_engine.trace import open_trace
    from dlm_engine.trace.recorder import TraceRecorder

    cls = strategy_class("wino")
    canvas = Canvas.from_prompts([[735, 559, 771, 678, 375, 377]], 32, 1000, 1001)
    rec = TraceRecorder(str(tmp_path / "w.dlmt"), {"format": "test"}, capture="confidence")
    seen = RecordingSink()
    decode(tiny_llada, canvas, cls(cls.Config(block_length=32, wide_in_thres=0.4, narrow_out_thres=0.95), 32),
           cache_class("none")(), sinks=[rec.sink(0, [0]), seen])
    rec.close()
    remasked = [(d.step, j) for d in seen.deltas if d.remask is not None for j in d.remask[0].nonzero().flatten().tolist()]
    assert remasked, "the configuration must re-mask something"
    seq = next(iter(open_trace(tmp_path / "w.dlmt")))
    g = canvas.gen_start
    assert seq.tokens.tolist() == canvas.tokens[0, g:].tolist()
    step, col = remasked[0]
    pos = seen.deltas[0].start - g + col                          # generated position
    assert seq.edits is not None and g + pos in seq.edits["col"].tolist()   # edits name canvas columns
    assert int(seq.state_at(step)[pos]) == 1000                     # masked again right after the re-mask


def test_shadow_slot_zero_reads_its_own_state_with_the_option(tiny_dream_model):
    """Quirk 11: a shifted model's (Dream's) shadow slot 0 reads the canvas' last hidden state; with
    shadow_shift_within it reads its own. The decoded slot 0's re-scoring confidence changes (on the tiny
    model no decision flips, so the tokens stay)."""
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import cache_class, strategy_class
    from dlm_engine.app.sinks import RecordingSink

    cls = strategy_class("wino")
    conf = {}
    for within in (False, True):
        canvas = Canvas.from_prompts([[406, 710, 869, 657, 230, 402]], 32, 1000, 1001)
        rec = RecordingSink()
        decode(tiny_dream_model, canvas, cls(cls.Config(block_length=8, shadow_shift_within=within), 32),
               cache_class("none")(), sinks=[rec])
        conf[within] = [d.confidence[0, 0].item() for d in rec.deltas if not d.commit[0, 0]]
    assert conf[False] and conf[False] != conf[True]


def test_reference_positions_number_dream_rows_from_zero():
    """Quirk 12: the reference's Dream copy gives left-padded rows positions 0..L-1 (RoPE depends on position
    differences, so this changes outputs only through rounding); the option uses the padding-aware ones."""
    from dlm_engine.core.canvas import Canvas, ModelInfo
    from dlm_engine.core.registry import strategy_class

    cls = strategy_class("d2c")
    canvas = Canvas.from_prompts([[5, 6], [5, 6, 7, 8]], 8, 9, 0)

    def first_plan(**kw):
        s = cls(cls.Config(**kw), 8)
        st = s.init_state(canvas)
        st = s.settle(canvas, st, s.reads(canvas, st).reshape(-1).tolist(), None)   # the first host read
        return s.plan(canvas, st)[0]

    canvas.model_info = ModelInfo("Dream", 1)
    assert torch.equal(first_plan().position_ids[0], torch.arange(canvas.length))
    assert first_plan(reference_positions=False).position_ids is None          # the canvas' cumsum positions
    canvas.model_info = ModelInfo("llada", 0)
    assert first_plan().position_ids is None


@pytest.mark.slow
def test_wino_run_through_dlm_and_the_trace_tools(tmp_path):
    """A WINO run through `dlm` records its re-masks: `replay --step` marks re-masked positions (░) apart from
    never-decoded ones (▒), `show` counts the edits, the HTML page styles them, `verify --rerun` reproduces it."""
    from conftest import run_dlm

    out = tmp_path / "run"
    proc = run_dlm(["strategy=wino", "strategy.wide_in_thres=0.4", "strategy.narrow_out_thres=0.99",
                    'prompts=["sum 13:","name a color:","123+456="]', f"hydra.run.dir={out}", "device=cpu"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    trace = str(out / "trace.dlmt")
    steps = [run_dlm(["replay", "--step", str(k), "--json", trace], cwd=tmp_path, exe="dlm-trace") for k in range(1, 6)]
    assert all(p.returncode == 0 for p in steps)
    rows = [r for p in steps for r in json.loads(p.stdout)]
    hit = [r for r in rows if r["remasked"]]
    assert hit, "this configuration re-masks on the tiny model"
    text = run_dlm(["replay", "--step", str(hit[0]["step"]), trace], cwd=tmp_path, exe="dlm-trace").stdout
    assert "\u2591" in text and "re-masked" in text
    show = run_dlm(["show", trace], cwd=tmp_path, exe="dlm-trace").stdout
    assert "edits" in show
    page = tmp_path / "t.html"
    assert run_dlm(["html", trace, "-o", str(page)], cwd=tmp_path, exe="dlm-trace").returncode == 0
    assert 'class="c r"' in page.read_text() and "re-masked at step" in page.read_text()
    ver = run_dlm(["verify", "--rerun", trace], cwd=tmp_path, exe="dlm-trace")
    assert ver.returncode == 0 and "reproduced" in ver.stdout, ver.stdout + ver.stderr


@pytest.mark.parametrize("name, kw", [
    ("d2c", {}), ("d2c", {"threshold": 0.3}), ("d2c", {"factor": 1.0}), ("d2c", {"sigma": 2.0}),
    ("d2c", {"debias": True, "freq_table": "llada"}), ("d2c", {"alg": "topk_margin", "top_k": 3}),
    ("d2c", {"alg": "topk_margin", "stop_until_eos": True}), ("ar", {"threshold": 0.3}),
    ("d2c", {"threshold": 0.5, "batch": 1}),
])
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_block_candidates_only_sampling_is_exact(tiny_llada, monkeypatch, name, kw, cache):
    """At T = 0 the d2c family's fast layer (core/fast/block_scored.py: BlockScored) samples only the block's
    candidates (quirk 15's every-position sampling costs a softmax over G x V a step); commits, tokens and committed
    confidences equal those of the plain rule, which samples every position (``decode(..., fast=False)``), on a
    padded batch of three."""
    import dlm_engine.core.sampler as sampler
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import cache_class, strategy_class
    from fakes import CommittedDeltas

    monkeypatch.setattr(sampler, "SCORED_MIN_SAVING", 0)     # the tiny vocabulary never pays for the gathering
    cls = strategy_class(name)
    kw = dict(kw)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]][:kw.pop("batch", 3)]
    out, calls = {}, {True: [], False: []}
    orig = cls.sample_at
    for fast in (True, False):
        def spy(self, logits, where, count, st, _sizes=calls[fast]):
            _sizes.append((count, logits.shape[0] * logits.shape[1]))
            return orig(self, logits, where, count, st)

        monkeypatch.setattr(cls, "sample_at", spy)
        canvas = Canvas.from_prompts(prompts, 16, int(tiny_llada.config.mask_token_id), 0,
                                     eos_id=int(tiny_llada.config.eos_token_id))
        sink = CommittedDeltas()
        decode(tiny_llada, canvas, cls(cls.Config(block_length=4, **kw), 16), cache_class(cache)(), sinks=[sink],
               fast=fast)
        out[fast] = (canvas.tokens.tolist(), canvas.step_of.tolist(), canvas.nfe, sink.seen)
    assert calls[True] and all(m < n for m, n in calls[True]) and not calls[False]
    assert out[True] == out[False]


def test_a_cache_that_reads_confidences_gets_every_position(tiny_llada, monkeypatch):
    """d2Cache's confidence cache reads every position's step confidence (Cache.reads_confidence): with it
    the strategy keeps sampling every generated position."""
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import cache_class, strategy_class

    cls = strategy_class("d2c")
    seen = []

    class Spy(cls):
        def sample_at(self, *a, **k):
            seen.append(True)
            return super().sample_at(*a, **k)

    import dlm_engine.core.sampler as sampler

    monkeypatch.setattr(sampler, "SCORED_MIN_SAVING", 0)
    assert cache_class("d2cache").reads_confidence and not cache_class("none").reads_confidence
    for cache, expect in (("d2cache", False), ("none", True)):
        seen.clear()
        canvas = Canvas.from_prompts([[5, 6, 7, 8]], 16, int(tiny_llada.config.mask_token_id), 0)
        decode(tiny_llada, canvas, Spy(cls.Config(block_length=4), 16), cache_class(cache)())
        assert bool(seen) == expect, cache


@pytest.mark.parametrize("kw", [{"alg": "entropy"}, {"gamma": 0.05}, {"top_p": 0.9}, {"temperature": 0.5},
                                {"alg": "random"}, {"subclass": True}])
def test_sums_draws_and_undeclared_picks_keep_every_position(tiny_llada, monkeypatch, kw):
    """A sum over the vocabulary (entropy, EB's budget, top-p's cumulative mass) may reduce differently for
    fewer positions, a draw's stream depends on every position, and a subclass whose own ``pick`` does not
    is the composed class's ``block_pick`` may read every distribution: all of these sample every position."""
    import dlm_engine.core.sampler as sampler
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import strategy_class

    monkeypatch.setattr(sampler, "SCORED_MIN_SAVING", 0)
    cls = strategy_class("d2c")
    kw = dict(kw)
    if kw.pop("subclass", False):
        class Reads(cls):
            def pick(self, scores, cand, block_cand, sampled, st, rows, counts):
                assert sampled.probs is not None
                return super().pick(scores, cand, block_cand, sampled, st, rows, counts)
        cls = Reads
    seen = []
    orig = cls.sample_at
    monkeypatch.setattr(cls, "sample_at", lambda self, *a: seen.append(1) or orig(self, *a))
    canvas = Canvas.from_prompts([[5, 6, 7, 8]], 16, int(tiny_llada.config.mask_token_id), 0)
    decode(tiny_llada, canvas, cls(cls.Config(block_length=4, **kw), 16))
    assert not seen and canvas.nfe > 0


def test_wino_cap_is_the_float32_product_of_the_spec():
    """d2cache.md: ``⌊0.7·n⌋`` is ``int(float32(n)·float32(0.7))`` (the float32 product, then truncated), equal to
    the exact floor below n = 200. The double product of the float32 factors truncates n = 10 to 6, not 7."""
    from dlm_engine.strategies.wino import wide_cap

    for n in range(0, 4097):
        want = int((torch.tensor(float(n), dtype=torch.float32) * 0.7).item())
        assert wide_cap(n, 1) == max(min(max(want, 5), 20), 1), n
        if n < 200:
            assert want == (7 * n) // 10, n
    assert wide_cap(10, 1) == 7 and wide_cap(20, 1) == 14 and wide_cap(3, 8) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eb_entropy_is_categoricals_bit_for_bit(dtype):
    """EB-Sampler's entropies come from an in-place copy of ``Categorical(probs).entropy()``'s kernels: the same
    bits, including exact 0s and 1s, unnormalised rows and NaN rows."""
    from dlm_engine.core.selection import _categorical_entropy

    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 7, 50, generator=g, dtype=dtype) * 4, -1)
    p[0, 0] = 0.0
    p[0, 0, 3] = 1.0                                   # a certain position
    p[1, 2] *= 3.0                                     # not normalised
    p[2, 4, :10] = 0.0                                 # zeros inside a row
    p[2, 5] = float("nan")
    want = torch.distributions.Categorical(probs=p, validate_args=False).entropy()
    got = _categorical_entropy(p.clone())
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


@pytest.mark.parametrize("kw", [dict(threshold=0.5), dict(threshold=0.5, num_transfer_tokens=2), dict(),
                                dict(ar_respect_ntt=True, num_transfer_tokens=3)])
def test_ar_pick_is_the_run_from_the_first_candidate(kw):
    """``ar`` commits the first ``count`` positions of the contiguous run of candidates starting at the row's first
    candidate (d2cache.md §8): checked row by row against a plain loop, on random rows with gaps and NaN scores."""
    from dlm_engine.core.registry import strategy_class

    cls = strategy_class("ar")
    ar = cls(cls.Config(**kw), 16)
    g = torch.Generator().manual_seed(0)
    cand = torch.rand(400, 16, generator=g) < 0.6
    scores = torch.rand(400, 16, generator=g, dtype=torch.float64)
    scores[torch.rand(400, 16, generator=g) < 0.05] = float("nan")
    commit, _ = ar.pick(scores, cand, cand, None, None, None, None)
    ntt, thr = ar.cfg.num_transfer_tokens, kw.get("threshold")
    for r in range(cand.shape[0]):
        c, s = cand[r].tolist(), scores[r].tolist()
        run = []
        for j in range(c.index(True) if True in c else 16, 16):
            if not c[j]:
                break
            run.append(j)
        if thr is not None:
            lead = 0
            while lead < len(run) and s[run[lead]] >= thr:     # NaN fails
                lead += 1
            count = min(max(lead, ntt), len(run))
        else:
            count = min(len(run), ntt) if kw.get("ar_respect_ntt") else len(run)
        assert [j for j in range(16) if commit[r, j]] == run[:count], r


def test_d2c_reads_count_the_eligible_positions_on_the_canvas():
    """What the next plan reads (``reads``): per row and block, the masked positions a step may decode -- none in a
    finished row, none after a row's first decoded EOS with ``stop_until_eos`` -- counted on the canvas; ``settle``
    moves to the next block once the step left none in the current one."""
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.registry import strategy_class

    cls = strategy_class("d2c")
    mask, eos = 9, 3
    canvas = Canvas.from_prompts([[5, 6], [7, 8], [1, 2]], 8, mask, 0, eos_id=eos)
    g = canvas.gen_start

    def write(canvas, row, col, token):                              # a decoded position (at step 1)
        canvas.tokens[row, canvas.gen_start + col], canvas.step_of[row, canvas.gen_start + col] = token, 1

    for col in range(4):
        write(canvas, 0, col, 4)                                     # row 0: block 0 filled
    write(canvas, 1, 1, eos)                                         # row 1: an EOS decoded at column 1
    canvas.finished[2] = True                                        # row 2: finished
    plain = cls(cls.Config(block_length=4), 8)
    until_eos = cls(cls.Config(block_length=4, stop_until_eos=True), 8)
    st = plain.init_state(canvas)
    assert plain.reads(canvas, st).tolist() == [[0, 4], [3, 4], [0, 0]]
    assert until_eos.reads(canvas, until_eos.init_state(canvas)).tolist() == [[0, 4], [1, 0], [0, 0]]
    values = plain.reads(canvas, st).reshape(-1).tolist()
    assert plain.settle(canvas, st, values, None).block == 0          # (before the first step: nothing ends)
    done = Canvas.from_prompts([[5, 6]], 8, mask, 0)
    for col in range(4):
        write(done, 0, col, 4)
    after = plain.settle(done, st, plain.reads(done, st).reshape(-1).tolist(), object())
    assert (after.block, after.step, after.counts) == (1, 0, ((0, 4),))


@pytest.mark.parametrize("kw", [dict(block_length=8), dict(block_length=4, num_transfer_tokens=3), dict(sigma=10.0),
                                dict(threshold=0.5), dict(stop_until_eos=True), dict(eos_fill=True)])
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_d2c_deltas_count_their_commits_and_finish_rows_on_the_canvas(tiny_llada, kw, cache):
    """Every d2c delta's ``committed`` scalar is its commits per row, and it finishes exactly the rows left with
    nothing to decode: with the fixed rate a row commits ``min(num_transfer_tokens, masked left in the block)``;
    every row ends finished."""
    from dlm_engine.app.sinks import RecordingSink
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import cache_class, strategy_class

    cls = strategy_class("d2c")
    s = cls(cls.Config(**kw), 16)
    mask = int(tiny_llada.config.mask_token_id)
    canvas = Canvas.from_prompts([[5, 6, 7, 8], [9, 10, 11, 12]], 16, mask, 0,
                                 eos_id=int(tiny_llada.config.eos_token_id))
    rec = RecordingSink()
    with torch.inference_mode():
        decode(tiny_llada, canvas, s, cache_class(cache)(), sinks=[rec])
    g, ntt = canvas.gen_start, s.cfg.num_transfer_tokens
    fixed = not {"threshold", "stop_until_eos", "eos_fill"} & set(kw)
    masked_before = torch.ones(2, 16, dtype=torch.bool)
    finished_before = torch.zeros(2, dtype=torch.bool)
    for d, tokens in zip(rec.deltas, rec.states):           # (the canvas' tokens once the delta is applied)
        n = d.commit.sum(-1)
        assert d.scalars["committed"].tolist() == n.tolist()
        masked = tokens[:, g:] == mask
        if not kw.get("stop_until_eos"):                    # (there a row finishes with masks after its EOS)
            assert d.finished.tolist() == (~masked.any(-1) & ~finished_before).tolist()
        if fixed:
            a, b = s.block_cols(d.scalars["block"])
            assert n.tolist() == (masked_before[:, a:b].sum(-1).clamp(max=ntt) * d.active).tolist()
        masked_before, finished_before = masked, finished_before | d.finished
    assert bool(canvas.finished.all()) and canvas.step > 2


def _spec_klass(base):
    """KLASS exactly as d2cache.md §8 states it: every generated position's divergence every step, float64 history
    ``[B, G, H]`` and previous distributions ``[B, G, V]`` updated for the call's rows."""
    from dlm_engine.core.selection import d2c_commit

    class SpecKlass(base):
        partial_steps = 0

        def init_state(self, canvas):
            self.hist = self.prev = None
            return super().init_state(canvas)

        def sample_from(self, st, proposal):
            return 0                                    # every generated position's distribution, every step

        def pick(self, scores, cand, block_cand, sampled, st, rows, counts):
            c = self.cfg
            p = sampled.probs.to(torch.float64)
            if self.hist is None:
                B = st.batch
                self.hist = torch.zeros((B, p.shape[1], c.kl_history_length), dtype=torch.float64)
                self.prev = torch.zeros((B,) + tuple(p.shape[1:]), dtype=torch.float64)
            mine = slice(None) if rows is None else rows
            self.partial_steps += rows is not None
            kl = (p * (torch.log(p + 1e-12) - torch.log(self.prev[mine] + 1e-12))).sum(-1)
            h = torch.roll(self.hist[mine], -1, dims=-1)
            h[:, :, -1] = kl
            self.hist[mine] = h
            self.prev[mine] = p
            pool = block_cand & (h < c.kl_threshold).all(-1)
            if c.threshold is None and c.factor is None and c.klass_commit_stable:
                chosen = pool
            else:
                chosen = d2c_commit(scores, pool, 0, threshold=c.threshold, factor=c.factor)
            fallback = d2c_commit(scores, block_cand, c.num_transfer_tokens, counts=counts)
            return torch.where(chosen.any(-1, keepdim=True), chosen, fallback), st

    return SpecKlass


@pytest.mark.parametrize("kw", [dict(threshold=0.3, kl_threshold=2.0), dict(threshold=0.3, kl_threshold=5.0,
                                                                             kl_history_length=1),
                                dict(threshold=0.2, kl_threshold=2.0, kl_history_length=3),
                                dict(klass_commit_stable=True, kl_threshold=1.0, num_transfer_tokens=2),
                                dict(factor=2.0, kl_threshold=1.0)])
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_klass_history_of_a_new_block_is_the_specs(tiny_llada, kw, cache):
    """KLASS measures the divergences from its block's first column on (the earlier blocks' history is dropped;
    its fast layer samples those columns only): the commits are the spec's, which recomputes every position every
    step -- over several blocks, for a batch whose rows sit steps out (their history must not move) and with
    stable sets that change what is committed."""
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import cache_class, strategy_class

    base = strategy_class("klass")
    tails = []

    class cls(base):                                     # KLASS, counting the steps sampled from a block's start
        def sample_from(self, st, proposal):
            first = super().sample_from(st, proposal)
            tails.append(first)
            return first

    spec_cls = _spec_klass(base)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16], [20]]
    mask = int(tiny_llada.config.mask_token_id)
    out = {}
    for name, k, extra in (("klass", cls, {}), ("spec", spec_cls, {}), ("never stable", cls, {"kl_threshold": 1e-30})):
        canvas = Canvas.from_prompts(prompts, 24, mask, 0)
        s = k(k.Config(block_length=6, **dict(kw, **extra)), 24)
        with torch.inference_mode():
            decode(tiny_llada, canvas, s, cache_class(cache)())
        out[name] = (canvas.tokens, canvas.step_of, s)
    assert torch.equal(out["klass"][0], out["spec"][0]) and torch.equal(out["klass"][1], out["spec"][1])
    assert out["spec"][2].partial_steps > 0                                    # rows sat steps out
    assert not torch.equal(out["klass"][1], out["never stable"][1])            # the stable sets mattered
    assert any(first > 0 for first in tails)            # steps that sampled from their block's start on (T = 0)


def test_klass_samples_from_the_blocks_start_only_where_that_is_exact():
    """At T = 0 with a per-position confidence KLASS samples from its block's first column on (the earlier,
    full blocks are never read); a draw (T > 0), a confidence that sums over the vocabulary, top-p, sampling
    candidates only, or a cache that reads every position's confidence keep every position."""
    from types import SimpleNamespace

    from dlm_engine.core.registry import strategy_class
    from dlm_engine.strategies.d2c import BlockState, D2CRule

    cls = strategy_class("klass")
    plain = SimpleNamespace(all_confidences=False)
    at_block = BlockState(block=2)
    assert cls(cls.Config(block_length=4), 16).sample_from(at_block, plain) == 8
    assert cls(cls.Config(block_length=4, alg="topk_margin", top_k=3), 16).sample_from(at_block, plain) == 8
    assert cls(cls.Config(block_length=4), 16).sample_from(BlockState(block=0), plain) == 0
    for kw in (dict(temperature=0.5), dict(alg="entropy"), dict(top_p=0.9), dict(sample_candidates_only=True)):
        assert cls(cls.Config(block_length=4, **kw), 16).sample_from(at_block, plain) == 0, kw
    assert cls(cls.Config(block_length=4), 16).sample_from(at_block, SimpleNamespace(all_confidences=True)) == 0
    assert issubclass(cls, D2CRule) and not hasattr(D2CRule, "sample_from")      # the plain rule samples them all
