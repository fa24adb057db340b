"""What a native (C++) selection rule would save: evidence for issue 17's item 1, not a feature.

On the embedded model the CPU outside the forward is a few dozen small tensor operations a step, and each one
runs on CPU caches the forward has just emptied: ~10-35 us an operation instead of the ~3-5 us a warm loop
measures. This script takes one of those rules -- Fast-dLLM's threshold commit as the threshold strategy calls
it (``threshold_commit(..., candidates_only=True)`` and the commit count) -- builds the same rule as one fused
C++ function (``torch.utils.cpp_extension.load_inline``; needs a C++ compiler and the ``ninja`` package),
checks that both give the same commits and counts on random windows (exact ties included, and a row holding a
NaN), and times each call on cold caches (right after a real forward of the embedded model) and warm (called back
to back). Where a row's top score is tied the native rule defers to the eager one: ``torch.topk`` orders exact
ties its own way, not by first index.

    python experiments/bench_native_rule.py [--calls 300] [--width 16]

Prints per-call CPU (thread time) for eager and native, cold and warm, and the ratios. Nothing in the engine
uses the native rule; the numbers are for the team's decision on a native selection path.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from dlm_engine.core.selection import threshold_commit  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <limits>

// Fast-dLLM's threshold rule over one window: the first maximum among each row's candidates (a NaN is a
// maximum, as torch.argmax has it), plus every candidate scoring >= tau; returns (commit, count per row), or
// nothing when a row's top score is tied: the eager rule ranks with torch.topk, whose order among exact ties is
// its own (not the first index), so the caller falls back to it there.
std::vector<at::Tensor> threshold_commit(const at::Tensor& conf, const at::Tensor& cand, double tau) {
  TORCH_CHECK(conf.dim() == 2 && conf.scalar_type() == at::kDouble && conf.is_contiguous(), "conf: [B, W] float64");
  TORCH_CHECK(cand.sizes() == conf.sizes() && cand.scalar_type() == at::kBool && cand.is_contiguous(), "cand");
  const int64_t B = conf.size(0), W = conf.size(1);
  auto commit = at::empty({B, W}, cand.options());
  auto count = at::empty({B}, conf.options().dtype(at::kLong));
  const double* c = conf.data_ptr<double>();
  const bool* m = cand.data_ptr<bool>();
  bool* out = commit.data_ptr<bool>();
  int64_t* n = count.data_ptr<int64_t>();
  const double ninf = -std::numeric_limits<double>::infinity();
  for (int64_t b = 0; b < B; ++b) {
    const double* cr = c + b * W; const bool* mr = m + b * W; bool* o = out + b * W;
    int64_t best = 0; double bv = mr[0] ? cr[0] : ninf; bool tied = false;
    for (int64_t j = 1; j < W; ++j) {
      const double v = mr[j] ? cr[j] : ninf;
      if (!std::isnan(bv) && (std::isnan(v) || v > bv)) { bv = v; best = j; tied = false; }
      else if (v == bv || (std::isnan(v) && std::isnan(bv))) { tied = true; }
    }
    if (tied) return {};
    int64_t k = 0;
    for (int64_t j = 0; j < W; ++j) {
      const bool x = mr[j] && (cr[j] >= tau || j == best);
      o[j] = x; k += x;
    }
    n[b] = k;
  }
  return {commit, count};
}
"""


def eager_rule(conf, cand, tau, counts):
    commit = threshold_commit(conf, cand, tau, None, counts, candidates_only=True)
    return commit, commit.sum(-1)


def random_case(gen, B, W):
    conf = torch.rand((B, W), generator=gen, dtype=torch.float64)
    conf = torch.where(torch.rand((B, W), generator=gen) < 0.3, torch.round(conf * 4) / 4, conf)  # exact ties
    cand = torch.rand((B, W), generator=gen) < 0.6
    cand[:, 0] |= ~cand.any(-1)        # candidates_only: every row has a candidate, none scores -inf
    return conf, cand


def with_fallback(ext, conf, cand, tau, counts):
    """The native rule, or the eager one where a row's top score is tied (the native rule returns nothing)."""
    out = ext.threshold_commit(conf, cand, tau)
    return out if out else eager_rule(conf, cand, tau, counts)


def check(ext, trials=2000):
    """Native-with-fallback against eager on random windows; returns (trials, how many fell back)."""
    gen = torch.Generator().manual_seed(0)
    fell = 0
    for t in range(trials):
        B, W = 1 + t % 4, 1 + (t * 7) % 40
        conf, cand = random_case(gen, B, W)
        tau = (0.0, 0.5, 0.9, 1.0)[t % 4]
        counts = [int(v) for v in cand.sum(-1)]
        if len(set(counts)) > 1:       # the eager call path of one shared count (the threshold strategy's)
            cand[:] = cand[:1]
            counts = [counts[0]] * B
        fell += not ext.threshold_commit(conf, cand, tau)
        a, b = eager_rule(conf, cand, tau, counts), with_fallback(ext, conf, cand, tau, counts)
        if not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])):
            raise SystemExit(f"native rule differs from the eager one on trial {t} (B={B}, W={W}, tau={tau})")
    # a NaN is the maximum for both (the generic path: no counts, torch.argmax's first NaN)
    conf = torch.tensor([[0.2, float("nan"), 0.95, 0.3]], dtype=torch.float64)
    cand = torch.tensor([[True, True, True, True]])
    if not torch.equal(threshold_commit(conf, cand, 0.9), ext.threshold_commit(conf, cand, 0.9)[0]):
        raise SystemExit("native rule differs from the eager one on a row with NaN")
    return trials, fell


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--width", type=int, default=16, help="window width (the embedded model's gen is 16)")
    args = ap.parse_args(argv)
    try:
        import ninja  # noqa: F401
    except ImportError:
        print("bench_native_rule: needs the 'ninja' package (pip install ninja) to build the C++ rule", file=sys.stderr)
        return 2
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        print("bench_native_rule: needs a C++ compiler (c++ or $CXX) to build the rule", file=sys.stderr)
        return 2
    from torch.utils.cpp_extension import load_inline

    from dlm_engine.checkpoints import embedded_path
    from dlm_engine.models.loader import load_pretrained

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ext = load_inline("dlm_native_threshold_probe", cpp_sources=SOURCE, functions=["threshold_commit"],
                      extra_cflags=["-O2"], verbose=False)
    print(f"build (or load from torch's extension cache): {time.perf_counter() - t0:.1f} s")
    trials, fell = check(ext)
    print(f"same commits and counts as the eager rule on {trials} random windows "
          f"({fell} fell back to it: a tied top score, where torch.topk's own tie order decides)")

    model = load_pretrained(embedded_path("tiny"))[0]
    mask_id = model.mask_token_id
    ids = torch.tensor([[5, 6, 7, 8, 9, 10] + [mask_id] * args.width])
    gen = torch.Generator().manual_seed(1)
    conf, cand = random_case(gen, 1, args.width)
    counts = [int(cand.sum())]
    rules = {"eager": lambda: eager_rule(conf, cand, 0.9, counts),
             "native": lambda: with_fallback(ext, conf, cand, 0.9, counts)}
    clock = time.thread_time_ns
    res = {name: {"cold": [], "warm": []} for name in rules}
    with torch.inference_mode():
        for rnd in range(2):                    # two interleaved rounds: a drift hits both
            for name, rule in rules.items():
                cold = warm = 0
                for _ in range(args.calls):
                    model(ids)
                    t = clock()
                    rule()
                    cold += clock() - t
                for _ in range(args.calls):
                    t = clock()
                    rule()
                    warm += clock() - t
                res[name]["cold"].append(cold / args.calls / 1e3)
                res[name]["warm"].append(warm / args.calls / 1e3)
    print(f"\nthreshold commit + count, B=1, W={args.width}, CPU us per call (best of 2 rounds of {args.calls})")
    print(f"{'':8}{'cold':>10}{'warm':>10}")
    best = {n: {k: min(v) for k, v in r.items()} for n, r in res.items()}
    for name, r in best.items():
        print(f"{name:8}{r['cold']:>10.1f}{r['warm']:>10.1f}")
    print(f"{'ratio':8}{best['eager']['cold'] / best['native']['cold']:>9.1f}x"
          f"{best['eager']['warm'] / best['native']['warm']:>9.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
