"""experiments/bench_block_diffusion.py: the block store decodes the same tokens with the same NFE while each
forward covers only the working block (small sizes; no timing is checked)."""
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
