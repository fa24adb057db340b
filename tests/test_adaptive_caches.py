"""The adaptive caches ``dllm`` (dLLM-Cache) and ``d2cache`` (d2Cache) and the d2Cache semantics of ``prefix``/``dual``:
every reference quirk is the default (the fixture case matches) and its option changes the output; batches;
capabilities; config errors; the exactness of full refreshes."""
import json

import pytest
import torch

from conftest import FIXTURES, decode_in_batches, small_strategies, watch_calls
from dlm_engine.core.canvas import Canvas
from dlm_engine.core.capabilities import incompatibility
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import cache_class, load_plugins, strategy_class
from dlm_engine.errors import ConfigError

D2C = FIXTURES / "d2cparity"


@pytest.fixture(scope="module")
def models(parity):
    from dlm_engine.models.loader import load_pretrained

    dirs = parity.model_dirs(D2C)
    return {name: load_pretrained(dirs[name], device="cpu", dtype="float32")[0] for name in ("tiny_llada", "tiny_dream")}


def _suite(name):
    data = json.loads((D2C / f"{name}.json").read_text())
    data["token_freq"] = json.loads((D2C / "d2c_pc.json").read_text())["token_freq"]
    return data


def run_fixture(parity, models, suite, cid, **options):
    """A fixture case run through parity.py with extra cache options; returns (result, case)."""
    data = _suite(suite)
    case = next(c for c in data["cases"] if c["id"] == cid)
    if options:
        case = dict(case, cache=dict(case["cache"], args=dict(case["cache"]["args"], **options)))
        if "shifted" in options:       # parity.py sets the d2Cache value itself: override it afterwards
            inner = parity.d2c_cache
            parity.d2c_cache = lambda spec: (lambda n, a: (n, dict(a, shifted=options["shifted"])))(*inner(spec))
            case["cache"]["args"].pop("shifted")
    try:
        res = parity.run_case(case, data["prompts"], models[case["model_dir"]], 1000, 1001, data)
    finally:
        if "shifted" in options:
            parity.d2c_cache = inner
    return res, case


def same(res, case):
    return res["output"] == case["output"] and res["nfe"] == case["nfe"] and res["unmask_step"] == case["unmask_step"]


DLLM = "d2c_dllm/llada/vanilla/dllm/p0/ntt1_code_defaults/gl32_bl8"
D2K8 = "d2c_d2cache/llada/vanilla/d2cache/p0/k8/gl32_bl32"
D2SEMI = "d2c_d2cache/dream/vanilla/d2cache/p0/k8_inflate4_semiar_b8/gl32_bl8"


@pytest.mark.slow
@pytest.mark.parametrize("suite, cid, option", [
    ("d2c_dllm", DLLM, {"layer0_full": False}),                     # quirk 13: layer 0 always recomputed
    ("d2c_dllm", DLLM, {"reset_per_block": True}),                  # quirk 14: state kept across blocks
    ("d2c_d2cache", D2K8, {"update_conf": True}),                   # quirk 2: confidence cache never refreshed
    ("d2c_d2cache", D2K8, {"full_block": True}),                    # quirk 3: in-place block mask
    ("d2c_d2cache", D2SEMI, {"reset_per_block": True}),             # quirk 14
    ("d2c_prefix", "d2c_prefix/dream/vanilla/prefix/p0/ntt1/gl32_bl8", {"shifted": "extend"}),   # Fast-dLLM's span
    ("d2c_prefix", "d2c_prefix/dream/vanilla/dual/p0/ntt1/gl32_bl8", {"shifted": "extend"}),
])
def test_reference_default_matches_and_the_option_changes_the_output(parity, models, suite, cid, option):
    res, case = run_fixture(parity, models, suite, cid)
    assert same(res, case)
    changed, _ = run_fixture(parity, models, suite, cid, **option)
    assert not same(changed, case)


@pytest.mark.slow
def test_dllm_shared_schedule_stops_where_the_reference_asserts_and_per_row_schedules_run(parity, models):
    """Quirk 13: rows that sit out different numbers of steps diverge; the reference's assertion becomes a
    one-line error; per-row schedules decode it, each row exactly as alone."""
    from dlm_engine.cache.dllm import ScheduleDiverged

    cid = "d2c_dllm/llada/vanilla/dllm/lp02/thr0.9_batch_lp02/gl32_bl8"
    with pytest.raises(ScheduleDiverged, match="per_row_schedule"):
        run_fixture(parity, models, "d2c_dllm", cid)
    res, case = run_fixture(parity, models, "d2c_dllm", cid, per_row_schedule=True)
    data = _suite("d2c_dllm")
    for i, p in enumerate(case["extra_inputs"]["batch"]):
        alone = dict(case, id=cid + f"/row{i}", extra_inputs={"attention_mask": "ones"}, prompt_idx=p)
        alone["cache"] = dict(case["cache"], args=dict(case["cache"]["args"], per_row_schedule=True))
        one = parity.run_case(alone, data["prompts"], models["tiny_llada"], 1000, 1001, data)
        g = len(res["output"][i]) - 32
        assert res["output"][i][g:] == one["output"][-32:]
    # where the rows never diverge, per-row schedules are the shared one
    ok = "d2c_dllm/llada/vanilla/dllm/lp02/batch_lp02/gl32_bl8"
    res, case = run_fixture(parity, models, "d2c_dllm", ok, per_row_schedule=True)
    assert same(res, case)


# ------------------------------------------------------------------------------------------------ in the engine
PROMPTS = [[735, 559, 771, 678, 375, 377], [127, 157, 983, 804, 991, 537, 902, 490, 136, 103, 962]]


def _decode(model, prompts, strategy, cache, gen=32, cache_kw=None, **kw):
    load_plugins()
    cls, ccls = strategy_class(strategy), cache_class(cache)
    canvas = Canvas.from_prompts(prompts, gen, 1000, 1001)
    decode(model, canvas, cls(cls.Config(**kw), gen), cache=ccls(ccls.Config(**(cache_kw or {}))))
    return canvas


def test_dllm_batch_rows_equal_rows_alone_with_a_fixed_rate(models):
    """low_confidence steps every row in lockstep, so the shared schedule is each row's own: a left-padded batch
    decodes every row as it decodes alone."""
    model = models["tiny_llada"]
    kw = dict(steps=16, block_length=8)
    batch = _decode(model, PROMPTS, "low_confidence", "dllm", cache_kw={"kr": 3, "kp": 5}, **kw)
    for i, p in enumerate(PROMPTS):
        one = _decode(model, [p], "low_confidence", "dllm", cache_kw={"kr": 3, "kp": 5}, **kw)
        assert torch.equal(batch.tokens[i, batch.gen_start:], one.tokens[0, one.gen_start:])


def test_d2cache_duplicated_prompts_decode_like_the_prompt_alone(models):
    """Rows of a d2Cache batch share the top-up and the maxima of the block bonus, so in general a row depends on
    the others; identical rows never do."""
    model = models["tiny_dream"]
    kw = dict(threshold=0.3, block_length=8)
    batch = _decode(model, [PROMPTS[1]] * 2, "threshold", "d2cache", cache_kw={"current_k": 4}, **kw)
    one = _decode(model, [PROMPTS[1]], "threshold", "d2cache", cache_kw={"current_k": 4}, **kw)
    for i in range(2):
        assert torch.equal(batch.tokens[i], one.tokens[0])
    assert batch.nfe == one.nfe


def test_dllm_refreshing_every_step_is_the_uncached_model(models):
    """kp = kr = 1: every step refreshes prompt and response in every layer, i.e. no cache."""
    for name in ("tiny_llada", "tiny_dream"):
        model = models[name]
        kw = dict(threshold=0.5, block_length=8)
        ref = _decode(model, PROMPTS, "threshold", "none", **kw)
        got = _decode(model, PROMPTS, "threshold", "dllm", cache_kw={"kp": 1, "kr": 1}, **kw)
        assert torch.equal(ref.tokens, got.tokens) and ref.nfe == got.nfe


def test_d2cache_logits_cover_only_the_query_set(models):
    """A cached d2Cache call fills logits (and ``valid``) exactly for the columns after its query set's columns
    (shifted models read the previous column), zeros elsewhere."""
    model = models["tiny_dream"]
    ccls = cache_class("d2cache")
    cache = ccls(ccls.Config(current_k=4))
    seen = watch_calls(cache)
    cls = strategy_class("d2c")
    canvas = Canvas.from_prompts(PROMPTS[:1], 16, 1000, 1001)
    decode(model, canvas, cls(cls.Config(block_length=8), 16), cache=cache)
    assert seen[0].valid is None or bool(seen[0].valid.all())          # the first call is full
    c = seen[3]
    lo = c.logits_range[0]
    idx = c.columns.index[0]
    want = torch.zeros(c.logits.shape[1], dtype=torch.bool)
    want[(idx + 1 - lo)[(idx + 1 >= lo) & (idx + 1 < c.logits_range[1])]] = True
    assert torch.equal(c.valid[0], want)
    assert bool((c.logits[0][~want] == 0).all()) and idx.numel() < c.length


def test_capabilities():
    load_plugins()
    lc = strategy_class("low_confidence")
    fixed = lc(lc.Config(steps=16, block_length=8), 16)
    problem = incompatibility(fixed, cache_class("d2cache")())
    assert "cache=d2cache" in problem and "block_logits" in problem
    for strategy in (fixed, strategy_class("threshold")(strategy_class("threshold").Config(block_length=8), 16)):
        assert incompatibility(strategy, cache_class("dllm")()) is None
    waiting = lc(lc.Config(steps=16, block_length=8, loop="fastdllm"), 16)
    assert incompatibility(waiting, cache_class("d2cache")()) is None
    assert incompatibility(strategy_class("d2c")(strategy_class("d2c").Config(), 16), cache_class("d2cache")()) is None
    dream = strategy_class("dream")
    assert incompatibility(dream(dream.Config(), 16), cache_class("dllm")()) is None     # every window's logits
    ccls = cache_class("dllm")
    nd = strategy_class("dream")(strategy_class("dream").Config(), 16)   # offers no blocks
    assert "blocks" in incompatibility(nd, ccls(ccls.Config(reset_per_block=True)))


@pytest.mark.parametrize("cache, key, value", [
    ("dllm", "kp", 0), ("dllm", "kr", -1), ("dllm", "rou", 1.5), ("d2cache", "current_k", 0),
    ("d2cache", "rollout_p", 2.0), ("d2cache", "sigma", 0.0), ("d2cache", "inflate_w", -1), ("prefix", "shifted", "left"),
])
def test_bad_values_name_the_key(cache, key, value):
    load_plugins()
    ccls = cache_class(cache)
    with pytest.raises(ConfigError, match=f"cache.{key}="):
        ccls(ccls.Config(**{key: value}))


# ------------------------------------------------------------------------------------------------ the trace option
def test_trace_records_the_recomputed_columns_of_every_step(models, tmp_path):
    """trace.recomputed=true: the per-step scalar ``recomputed`` holds, per row, the canvas columns each step's
    call recomputed (what the cache chose); the HTML view outlines them. Off by default."""
    from dlm_engine.core.protocol import recomputed_columns
    from dlm_engine.trace.reader import open_trace
    from dlm_engine.trace.recorder import TraceRecorder
    from dlm_engine.trace.tools import recomputed_ranges, to_html

    model = models["tiny_llada"]
    load_plugins()
    for cname, kw in (("d2cache", {"current_k": 4}), ("dllm", {})):
        ccls, scls = cache_class(cname), strategy_class("threshold")
        cache = ccls(ccls.Config(**kw))

        def by_row(c):
            rows = list(range(c.batch_size)) if c.request.rows is None else c.request.rows.tolist()
            return {r: recomputed_columns(c)[j].numpy().copy() for j, r in enumerate(rows)}

        seen = watch_calls(cache, by_row)
        for on in (True, False):
            seen.clear()
            canvas = Canvas.from_prompts(PROMPTS, 16, 1000, 1001)
            path = tmp_path / f"{cname}_{on}.dlmt"
            with TraceRecorder(str(path), {"model": {"mask_id": 1000}}, recomputed=on) as rec:
                decode(model, canvas, scls(scls.Config(block_length=8, threshold=0.5), 16), cache=cache,
                       sinks=[rec.sink(0, [0, 1])])
            tr = open_trace(str(path))
            assert tr.header["capture"]["recomputed"] is on
            for i, seq in enumerate(tr):
                if not on:
                    assert "recomputed" not in seq.steps.scalars and recomputed_ranges(seq) is None
                    continue
                steps = seq.steps                 # the steps the row took part in
                got = steps.scalars["recomputed"].astype(bool)
                assert got.shape == (len(steps.step), canvas.length) and len(steps.step) > 2
                for t, row in zip(steps.step.tolist(), got):
                    assert (row == seen[t - 1][i]).all()
                assert not got[1:].all()          # cached steps recompute a subset
            if on:
                page = to_html(tr)
                assert "recomputed at this step" in page and '"rec": {"1": [[0, ' in page


@pytest.mark.slow
def test_cli_runs_the_adaptive_caches_with_the_trace_option(tmp_path):
    from conftest import run_dlm

    run = tmp_path / "run"
    proc = run_dlm([f"hydra.run.dir={run}", "device=cpu", "strategy=threshold", "strategy.block_length=8",
                    "cache=d2cache", "cache.current_k=4", "trace.recomputed=true", "gen_length=16",
                    'prompts=["12+34="]', "print_outputs=false"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "page.html"
    proc = run_dlm(["html", str(run / "trace.dlmt"), "-o", str(out)], cwd=tmp_path, exe="dlm-trace")
    assert proc.returncode == 0, proc.stderr
    assert "recomputed at this step" in out.read_text()
    proc = run_dlm([f"hydra.run.dir={tmp_path / 'bad'}", "device=cpu", "cache=dllm", "cache.kp=0", "gen_length=16"],
                   cwd=tmp_path)
    assert proc.returncode != 0 and "cache.kp=0" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow   # ~2 s: in-process but seconds long: kept out of the quick tier (CI runs it)
def test_every_strategy_decodes_a_llada_batch_with_the_adaptive_caches(models):
    """Every registered strategy that pairs with dllm / d2cache decodes a left-padded LLaDA batch to the end (CFG's
    doubled batch included; in batches of the strategy's ``max_batch``, as the API feeds it); dllm with rou=0 reuses every cached output between refreshes (layers with no query)."""
    model = models["tiny_llada"]
    ran = []
    for sname, strategy in small_strategies(16):
        for cname, ckw in (("dllm", {}), ("dllm", {"rou": 0.0, "kr": 3}), ("d2cache", {"current_k": 4})):
            ccls = cache_class(cname)
            cache = ccls(ccls.Config(**ckw))
            if incompatibility(strategy, cache) is not None:
                continue
            for canvas in decode_in_batches(model, PROMPTS, 16, strategy, lambda: ccls(ccls.Config(**ckw))):
                assert not canvas.masked()[:, canvas.gen_start:].any(), (sname, cname)
            ran.append((sname, cname))
    assert {("threshold", "d2cache"), ("low_confidence", "dllm"), ("d2c", "d2cache"), ("factor", "dllm")} <= set(ran)
    lc = strategy_class("low_confidence")
    for cname in ("dllm", "d2cache"):
        canvas = Canvas.from_prompts(PROMPTS, 16, 1000, 1001)
        decode(model, canvas, lc(lc.Config(steps=16, block_length=8, cfg_scale=1.0, loop="fastdllm"), 16),
               cache_class(cname)())
        assert not canvas.masked()[:, canvas.gen_start:].any(), cname


def test_d2cache_builds_one_attention_mask_per_forward(tiny_llada, monkeypatch):
    """Layers with the same query rows share the key columns tensor, so a padded batch's attention mask is built
    once per model call (``layers._memo_mask`` keys on tensor identity), not once per layer."""
    import dlm_engine.models.layers as layers

    built = []
    orig = layers.attention_mask
    monkeypatch.setattr(layers, "attention_mask", lambda *a, **k: built.append(1) or orig(*a, **k))
    cls = strategy_class("d2c")
    canvas = Canvas.from_prompts([[5, 6, 7, 8], [9, 10]], 16, int(tiny_llada.config.mask_token_id), 0)
    decode(tiny_llada, canvas, cls(cls.Config(block_length=4), 16), cache_class("d2cache")())
    assert tiny_llada.config.n_layers > 1 and len(built) == canvas.nfe
