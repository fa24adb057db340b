"""lm-evaluation-harness adapter (optional extra ``eval``): ``--model dlm_engine``.

``model_args`` are ``dlm`` config overrides, so every strategy, cache and model preset is available::

    lm_eval --model dlm_engine \\
        --model_args model=llada_8b_instruct,model.path=DIR,strategy=threshold,strategy.threshold=0.9,gen_length=256,strategy.block_length=32 \\
        --tasks gsm8k --batch_size 8

``lm_eval --model dlm_engine`` finds the name through the start-up hook the install ships
(``dlm_engine/integrations/lm_eval_hook.py``); importing this module registers it too, and ``python -m dlm_engine.integrations.lm_eval``
(console script ``dlm-lm-eval``) runs lm-eval's command line with the name registered even without the hook.

``generate_until`` decodes with the configured strategy. The generation length is the config's
``gen_length`` (a diffusion canvas has a fixed size; ``max_gen_toks`` of a task can only shorten the
returned text), and the text is cut at the first of the task's ``until`` strings. The chat template follows
``model.chat_template`` (auto: on for instruct presets) unless lm-eval applies its own
(``--apply_chat_template``).

``loglikelihood`` (multiple-choice tasks) is the Monte-Carlo ELBO of :mod:`dlm_engine.integrations.likelihood`; extra
``model_args`` that are not ``dlm`` overrides: ``mc_samples`` (default 128), ``mc_batch_size`` (32) and
``greedy_check`` (true: ``is_greedy`` from a greedy one-token-per-step decode) and ``mc_eos_pad`` (false;
true scores the continuation followed by EOS up to ``gen_length``, the answer layout SFT models such as
LLaDA-Instruct and the embedded model are trained on). ``loglikelihood_rolling`` (perplexity tasks) raises.
"""
from __future__ import annotations

import logging
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from typing import Any, Dict, List, Optional, Tuple  # noqa: E402

from lm_eval.api.model import LM  # noqa: E402

from dlm_engine.integrations.lm_eval_hook import ALIASES, ENTRY  # noqa: E402  (the names the start-up hook registers)
log = logging.getLogger(__name__)
# the request's generation kwargs that generate_until applies; sampling settings come from the strategy config
HONOURED_GEN_KWARGS = {"until", "max_gen_toks"}


def _override(key: str, value: Any) -> str:
    from dlm_engine.app.compose import to_override

    return to_override(key, value, quote=False)


def _positive_int(value: Any, key: str) -> int:
    from dlm_engine.errors import ConfigError

    try:
        n = int(str(value))
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{key}={value} must be a positive integer")
    return n


def _flag(value: Any, key: str) -> bool:
    from dlm_engine.errors import ConfigError

    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}={value} must be true or false")


def compose_config(overrides: List[str]):
    """The ``dlm`` run config for a list of Hydra overrides (same schemas, presets and checks); a bad override
    raises :class:`~dlm_engine.errors.ConfigError` with the one line ``dlm`` prints."""
    from dlm_engine.app.compose import compose

    return compose(overrides)


def _in_lm_eval_command() -> bool:
    """True when this process is lm-eval's command line (``lm_eval``, ``python -m lm_eval``, ``dlm-lm-eval``)."""
    import sys
    from pathlib import Path

    argv0 = Path(sys.argv[0] if sys.argv else "")
    return (argv0.name in ("lm_eval", "lm-eval", "dlm-lm-eval")
            or argv0.as_posix().endswith(("lm_eval/__main__.py", "dlm_engine/integrations/lm_eval.py")))


def _exit_on_user_error(exc: Exception) -> None:
    """On lm-eval's command line a bad ``--model_args`` value is one line and exit 2, not lm-eval's traceback;
    called as a library (``simple_evaluate``), the exception propagates."""
    import sys

    if _in_lm_eval_command():
        print(f"dlm_engine: error: {exc}", file=sys.stderr)
        sys.stderr.flush()
        sys.exit(2)


class DLMEngineLM(LM):
    """dlm_engine behind lm-eval's ``LM`` interface: ``generate_until`` decodes with the configured
    strategy, ``loglikelihood`` uses the Monte-Carlo ELBO of :mod:`dlm_engine.integrations.likelihood`."""

    def __init__(self, batch_size: Any = 1, max_batch_size: Optional[int] = None, device: Optional[str] = None,
                 **model_args: Any):
        super().__init__()
        import torch

        from dlm_engine.app.run import validate
        from dlm_engine.app.api import load_model

        self.mc_samples = _positive_int(model_args.pop("mc_samples", 128), "mc_samples")
        self.mc_batch_size = _positive_int(model_args.pop("mc_batch_size", 32), "mc_batch_size")
        self.greedy_check = _flag(model_args.pop("greedy_check", True), "greedy_check")
        self.mc_eos_pad = _flag(model_args.pop("mc_eos_pad", False), "mc_eos_pad")
        overrides = [_override(k, v) for k, v in model_args.items()]
        if device is not None and "device" not in model_args:
            if str(device).startswith("cuda") and not torch.cuda.is_available():
                # lm-eval's command line passes device=cuda:0 even when --device is not given: keep our
                # default (device=auto) on a machine without CUDA instead of refusing to run
                log.warning("dlm_engine: lm-eval asked for device %s but CUDA is not available; using the "
                            "config's device (set model_args device=... to choose)", device)
            else:
                overrides.append(_override("device", device))
        bs = batch_size if isinstance(batch_size, int) or str(batch_size).isdigit() else None
        if bs is not None and "batch_size" not in model_args:
            overrides.append(_override("batch_size", int(bs)))
        self.cfg = compose_config(overrides)
        self.make_strategy, self.make_cache = validate(self.cfg)
        torch.manual_seed(int(self.cfg.seed))
        self.lm = load_model(self.cfg.model, self.cfg.device, self.cfg.dtype)
        self._external_template = False
        self._warned_gen_kwargs = False
        self.rows: List[Any] = []       # every generate_until row: per-sequence NFE, tokens, TPF, latency
        self.model_calls, self.wall_time = 0, 0.0
        if self.mc_eos_pad and self.lm.eos_id is None:
            from dlm_engine.errors import ConfigError

            raise ConfigError(f"mc_eos_pad=true but model '{self.lm.name}' has no eos_token_id")

    # -- lm-eval interface --------------------------------------------------------------------------
    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        """``model_args`` win over lm-eval's own ``--device``/``--batch_size`` (no duplicate-argument error)."""
        from dlm_engine.errors import UserError

        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        try:
            return cls(**dict(arg_dict), **extra)
        except UserError as exc:
            _exit_on_user_error(exc)
            raise

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def metrics(self):
        """Totals over every sequence ``generate_until`` decoded so far (:mod:`dlm_engine.metrics`)."""
        from dlm_engine.metrics import totals

        return totals([r for r in self.rows], model_calls=self.model_calls, wall_time=self.wall_time)

    @property
    def tokenizer_name(self) -> str:
        tok = self.lm.tokenizer
        return str(getattr(tok, "name_or_path", None) or self.lm.name).replace("/", "__")

    def chat_template(self, chat_template: Any = False) -> Optional[str]:
        return getattr(self.lm.tokenizer, "chat_template", None) or ""

    def apply_chat_template(self, chat_history: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval renders the prompt itself (``--apply_chat_template``): then ours is not applied again."""
        self._external_template = True
        return self.lm.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                     tokenize=False)

    def loglikelihood(self, requests) -> List[Tuple[float, bool]]:
        """Monte-Carlo ELBO of each continuation (:mod:`dlm_engine.integrations.likelihood`; ``mc_samples`` masks of
        ``mc_batch_size`` rows per forward) and, with ``greedy_check``, whether greedy one-token-per-step
        decoding reproduces it. Contexts are encoded as given (lm-eval's ``--apply_chat_template`` renders a
        template itself); the model's chat template is not added here."""
        import torch

        from dlm_engine.integrations.likelihood import greedy_matches, mc_loglikelihood

        pairs = [self._encode_pair(*r.args) for r in requests]
        if self.mc_eos_pad:  # the answer region of an SFT layout: continuation, then EOS up to gen_length
            size = int(self.cfg.gen_length)
            pairs = [(c, t + [int(self.lm.eos_id)] * max(0, size - len(t))) for c, t in pairs]
        gen = torch.Generator().manual_seed(int(self.cfg.seed))
        out = []
        for ctx, cont in pairs:
            out.append(mc_loglikelihood(self.lm, ctx, cont, self.mc_samples, self.mc_batch_size, gen))
        greedy = (greedy_matches(self.lm, [c for c, _ in pairs], [t for _, t in pairs], int(self.cfg.batch_size))
                  if self.greedy_check else [False] * len(pairs))
        results = list(zip(out, greedy))
        for r, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", r.args, res)
        return results

    def _encode_pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        """Token ids of context and continuation, split where the joint encoding splits (trailing spaces of
        the context move to the continuation, as lm-eval's own models do)."""
        tok = self.lm.tokenizer
        if tok is None:
            raise NotImplementedError(f"dlm_engine: model '{self.lm.name}' has no tokenizer")
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = list(tok(context + continuation, add_special_tokens=False)["input_ids"])
        ctx = list(tok(context, add_special_tokens=False)["input_ids"])
        return whole[:len(ctx)], whole[len(ctx):]

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError("dlm_engine: rolling (perplexity) log-likelihood is not defined for a "
                                  "diffusion LM here; use loglikelihood (multiple-choice) or generate_until tasks")

    def generate_until(self, requests) -> List[str]:
        import torch

        from dlm_engine.app.api import run_prompts

        contexts = [r.args[0] for r in requests]
        kwargs = [dict(r.args[1] or {}) for r in requests]
        temp = self.cfg.strategy.get("temperature")
        ignored = sorted({k for kw in kwargs for k, v in kw.items()
                          if k not in HONOURED_GEN_KWARGS and not sampling_agrees(k, v, temp)})
        if ignored and not self._warned_gen_kwargs:
            self._warned_gen_kwargs = True
            log.warning("dlm_engine: generation kwargs %s are not applied; sampling is the strategy's "
                        "(e.g. model_args strategy.temperature=0.7, gen_length=256)", ", ".join(ignored))
        if self._external_template:
            tok = self.lm.tokenizer
            ids = [list(tok(c, add_special_tokens=False)["input_ids"]) for c in contexts]
        else:
            ids = [self.lm.encode(c) for c in contexts]
        cfg = self.cfg
        torch.manual_seed(int(cfg.seed))
        stats = run_prompts(self.lm, ids, self.make_strategy, self.make_cache, int(cfg.gen_length),
                            int(cfg.batch_size), prompts=contexts, warmup=False, threads=cfg.threads,
                            fast=cfg.fast)
        self.rows.extend(stats.rows)
        self.model_calls += stats.model_calls
        self.wall_time += stats.wall_time
        from dlm_engine.metrics import summary_line

        import sys

        # per-sequence figures of this request set (lm-eval's results have no slot for them); totals: .metrics
        print(f"dlm_engine: generate_until: {summary_line(stats.totals)}", file=sys.stderr, flush=True)
        out = []
        for row, kw in zip(stats.rows, kwargs):
            text = cut(row.text, kw.get("until"), kw.get("max_gen_toks"), self.lm)
            out.append(text)
            self.cache_hook.add_partial("generate_until", (row.prompt, kw), text)
        return out


def sampling_agrees(key: str, value: Any, temperature: Optional[float]) -> bool:
    """A task's sampling kwarg that asks for what the strategy does anyway (``do_sample: false`` or
    ``temperature: 0`` with a greedy strategy, ``temperature`` equal to the strategy's): nothing to warn about."""
    greedy = not temperature
    if key == "do_sample" and isinstance(value, bool):
        return value != greedy
    if key == "temperature" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) == float(temperature or 0.0)
    return False


def cut(text: str, until, max_gen_toks: Optional[int] = None, lm=None) -> str:
    """The text up to the first stop string (and at most ``max_gen_toks`` tokens)."""
    if isinstance(until, str):
        until = [until]
    for stop in until or []:
        if stop:
            text = text.split(stop)[0]
    if max_gen_toks is not None and lm is not None and lm.tokenizer is not None:
        toks = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(toks) > int(max_gen_toks):
            text = lm.tokenizer.decode(toks[:int(max_gen_toks)])
    return text


def _register() -> None:
    """Register the model names with lm-eval: the class from the importable module, a lazy placeholder when
    this file runs as ``__main__`` (so the two copies never collide)."""
    from lm_eval.api.registry import model_registry

    target = DLMEngineLM if __name__ == "dlm_engine.integrations.lm_eval" else ENTRY
    for alias in ALIASES:
        try:
            model_registry.register(alias, target=target)
        except ValueError:  # already holds the class (imported before as dlm_engine.integrations.lm_eval)
            pass


_register()


def main() -> None:
    """``python -m dlm_engine.integrations.lm_eval``: lm-eval's own command line with ``--model dlm_engine`` known."""
    from lm_eval.__main__ import cli_evaluate

    from dlm_engine.core.memory import keep_freed_memory
    from dlm_engine.errors import UserError

    keep_freed_memory()

    try:
        cli_evaluate()
    except UserError as exc:
        _exit_on_user_error(exc)
        raise


if __name__ == "__main__":
    main()
