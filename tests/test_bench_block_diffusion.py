"""experiments/bench_block_diffusion.py: the block store decodes the same tokens with the same NFE while each
forward covers only the working block (small sizes; no timing is checked)."""
import pytest
import torch

from conftest import load_experiment


def test_block_store_rows_match_and_compute_less():
    bench = load_experiment("bench_block_diffusion")
    from dlm_engine.core.registry import load_plugins

    load_plugins()
    prompt = list(range(100, 140))
    with torch.inference_mode():
        for family in ("fdv2", "sdar"):
            model = bench.build(family, hidden=64, layers=1)
            a = bench.run(model, family, "none", prompt, 40)
            b = bench.run(model, family, "block_kv", prompt, 40)
            assert a["tokens"] == b["tokens"] and a["nfe"] == b["nfe"] and a["masked"] == b["masked"] == 0
            assert a["per_step"] == 40 + 40 and b["per_step"] < a["per_step"] / 2


def test_unknown_family_is_one_line(capsys):
    bench = load_experiment("bench_block_diffusion")
    assert bench.main(["--family", "llada9", "--reps", "1", "--prompt", "8", "--gen", "8"]) == 2
    assert "unknown family 'llada9'" in capsys.readouterr().err


def _with_eos(bench, model, family, prompt, gen):
    """The model with EOS's head row made a little stronger than the row of the token the reference loop emits
    most, so that the decode stops on EOS (the stop paths of the loops)."""
    toks = bench.run_reference(model, family, prompt, gen)["tokens"][len(prompt) if family != "llada2" else 0:]
    top = max(set(toks), key=toks.count)
    with torch.no_grad():
        model.lm_head.weight[bench.EOS] = 1.05 * model.lm_head.weight[top]
    return model


@pytest.mark.slow   # ~3 s: in-process but seconds long: kept out of the quick tier (CI runs it)
def test_reference_shaped_loops_give_the_engines_tokens():
    """The speed comparison is only meaningful at identical tokens: each family's reference-shaped loop (plain torch,
    written from the bdparity SPEC) returns exactly what dlm_engine's decode returns with each timed setting (the
    family's parity setting; Fast-dLLM v2 also with its block cache), with the same NFE, for prompts below / at /
    above a block, with several tokens committed on some steps and (Fast-dLLM v2, LLaDA2.0) a stop on EOS."""
    bench = load_experiment("bench_block_diffusion")
    from dlm_engine.core.registry import load_plugins

    load_plugins()
    multi, answers = {}, {}
    with torch.inference_mode():
        for family in ("fdv2", "sdar", "llada2"):
            _, cache, store, _ = bench.SETTINGS[family]
            caches = [cache] + ([store] if store else [])
            model = bench.build_model(family, hidden=64, layers=2, experts=8, head_scale=12.0)
            cases = [(list(range(100, 100 + P)), G) for P, G in ((40, 64), (32, 64), (11, 40))]
            for i, kw in enumerate(bench.settings(family)):
                for prompt, gen in cases:
                    ref = bench.run_reference(model, family, prompt, gen, kw)
                    for c in caches:
                        got = bench.run_engine(model, family, c, prompt, gen, kw)
                        assert (got["tokens"], got["nfe"]) == (ref["tokens"], ref["nfe"]), (family, kw, len(prompt), c)
                    written = len(ref["tokens"]) - (len(prompt) if family != "llada2" else 0)
                    multi[family] = multi.get(family, False) or ref["nfe"] < written
                    answers.setdefault((family, i), []).append(ref["tokens"])
            if family != "sdar":                                  # (the sdar setting has no stop ids)
                prompt, gen = cases[0]
                model = _with_eos(bench, model, family, prompt, gen)
                for kw in bench.settings(family):
                    ref = bench.run_reference(model, family, prompt, gen, kw)
                    assert bench.EOS in ref["tokens"] and ref["tokens"][-1] == bench.EOS
                    for c in caches:
                        got = bench.run_engine(model, family, c, prompt, gen, kw)
                        assert (got["tokens"], got["nfe"]) == (ref["tokens"], ref["nfe"]), (family, kw, "eos", c)
    assert multi == {"fdv2": True, "sdar": True, "llada2": True}     # several tokens per step on some steps
    # Fast-dLLM v2's block cache attends stale keys of the other sub-blocks: its tokens differ (its path is used)
    assert answers[("fdv2", 0)] != answers[("fdv2", 1)]


@pytest.mark.slow   # in-process but seconds long: kept out of the quick tier (CI runs it)
def test_comparison_rows_and_table(capsys):
    """``compare`` times both sides and reports one row per dlm_engine cache (LLaDA2.0: its parity cache ``none``
    and the block store); the printed table says the tokens are the same."""
    bench = load_experiment("bench_block_diffusion")
    from dlm_engine.core.registry import load_plugins

    load_plugins()
    with torch.inference_mode():
        rows = bench.compare("llada2", list(range(100, 140)), 24, 1,
                             model=bench.build_model("llada2", hidden=64, layers=2, experts=8))
    assert [r["cache"] for r in rows] == ["none", "block_store"]
    assert all(r["same"] and r["ref_nfe"] == r["nfe"] and r["cpu"] > 0 and r["ref_cpu"] > 0 for r in rows)
    assert bench.main(["--family", "sdar", "--reps", "1", "--prompt", "40", "--gen", "8"]) == 0
    out = capsys.readouterr().out
    assert "sdar" in out and out.rstrip().endswith("yes")
