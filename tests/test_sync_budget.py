"""Host synchronisations per step (issue 17): at most one per step outside the model forward, for every strategy
and cache (the adaptive ones too), at batch 1 and on a padded batch: the loop's single read of the finished rows
and what the strategy's next plan reads (:meth:`Strategy.reads`). A decode may add at most two before its first
step (the initial read, and a strategy's set-up such as Dream's infilling check). Counted by wrapping the tensor methods that force a
sync (``dlm_engine.core.instrument.SyncCounter``); runs on the CPU, where the same calls would stall a GPU."""
import numpy as np
import pytest
import torch

from dlm_engine.core.canvas import Canvas, ModelInfo
from dlm_engine.core.capabilities import incompatibility
from dlm_engine.core.instrument import ModelTimer, SyncCounter
from dlm_engine.core.loop import decode
from dlm_engine.app.sinks import RecordingSink
from dlm_engine.core.registry import strategy_class

from conftest import batch_cache

GEN = 16
SETUP = 2                # reads a decode may make before its first step
LLADA = [
    ("low_confidence", dict(steps=16, block_length=8)),
    ("low_confidence", dict(steps=8, remasking="random", temperature=0.5)),
    ("threshold", dict(block_length=8)),
    ("factor", dict(block_length=8)),
    ("threshold", dict(block_length=8, stop_at_eos=True, logits_eos_inf=True, confidence_eos_eot_inf=True)),
    ("early_exit", dict(answer_start=0, steps=16)),
    ("cadllm", dict(initial_block_length=8, min_block=4, max_block=8)),
    ("cadllm", dict(initial_block_length=8, min_block=4, max_block=8, prophet_enabled=True, min_confidence_gap=0.01,
                    min_confidence_commit=0.01, prophet_patience=1)),
    ("block_buffer", dict(block_length=4, buffer_size=2)),
    ("d2c", dict(block_length=8)),
    ("d2c", dict(threshold=0.9)),
    ("d2c", dict(factor=1.0)),
    ("d2c", dict(gamma=0.01)),
    ("d2c", dict(debias=True, freq_table="llada")),
    ("d2c", dict(sigma=10.0)),
    ("klass", dict(threshold=0.9)),
    ("ar", dict(threshold=0.9)),
    ("wino", dict()),
    ("wino", dict(shrinking_window=True, block_length=16)),
]
DREAM = [
    ("dream", dict(steps=8)),
    ("dream", dict(steps=8, alg="maskgit_plus")),
    ("dream", dict(steps=8, alg="origin")),
    ("dream", dict(steps=8, alg="confidence_threshold")),
    ("dream", dict(steps=8, block_length=8)),
    ("dream", dict(steps=8, block_length=8, alg="confidence_threshold", window="rest")),
]
CACHES = ("none", "prefix", "dual", "block_store", "dllm", "d2cache")
PROMPTS = {1: [[5, 6, 7, 8]], 3: [[5, 6, 7, 8], [9, 10], [11, 12, 13]]}


def counted(model, name, kw, cache, batch):
    cls = strategy_class(name)
    strategy = cls(cls.Config(**kw), GEN)
    c = batch_cache(cache)                     # (dllm: per-row schedules, which a padded batch needs)
    if incompatibility(strategy, c) is not None:
        return None
    canvas = Canvas.from_prompts(PROMPTS[batch], GEN, int(model.config.mask_token_id), 0,
                                 eos_id=getattr(model.config, "eos_token_id", None),
                                 device=next(model.parameters()).device)
    timer = ModelTimer(model)
    torch.manual_seed(0)
    with SyncCounter(timer) as counter:
        decode(timer, canvas, strategy, c)
    return counter, canvas.step


def check(model, name, kw, batch):
    """Every cache the strategy runs with: at most one read a step, plus the set-up reads."""
    ran = 0
    for cache in CACHES:
        res = counted(model, name, kw, cache, batch)
        if res is None:
            continue
        counter, steps = res
        ran += 1
        assert counter.total <= steps + SETUP, (
            f"{name} {kw} cache={cache} batch={batch}: {counter.total} host syncs for {steps} steps: {counter.counts}")
    assert ran, f"{name}: no cache ran"


def cases(settings):
    """(name, kw, batch) for batch 1 and a padded batch of 3, where the strategy takes batches."""
    out = []
    for i, (name, kw) in enumerate(settings):
        batches = [1] if strategy_class(name).max_batch == 1 or kw.get("shrinking_window") else [1, 3]
        out += [pytest.param(name, kw, b, id=f"{name}-{i}-b{b}") for b in batches]
    return out


@pytest.mark.parametrize("name, kw, batch", cases(LLADA))
def test_llada_strategies_read_the_host_once_per_step(tiny_llada, name, kw, batch):
    check(tiny_llada, name, kw, batch)


@pytest.mark.parametrize("name, kw, batch", cases(DREAM))
def test_dream_reads_the_host_once_per_step(tiny_dream_model, name, kw, batch):
    check(tiny_dream_model, name, kw, batch)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_strategy_reads_the_host_once_per_step_on_cuda(dtype):
    """The same budget with the models on a GPU, where each counted call would stall the device: every case and
    cache of the two tests above, in one test (one skip without a GPU)."""
    from conftest import FIXTURES, REFPARITY
    from dlm_engine.models.loader import load_pretrained

    for path, settings in ((REFPARITY / "tiny_llada", LLADA), (FIXTURES / "dreamparity" / "tiny_dream", DREAM)):
        model = load_pretrained(path, device="cuda", dtype=dtype)[0]
        for p in cases(settings):
            check(model, *p.values)


def test_the_counter_sees_a_sync(tiny_llada):
    """The check itself: a strategy that reads one more host value per step fails it."""
    from dlm_engine.strategies.threshold import Threshold

    class Chatty(Threshold):
        def select(self, canvas, plan, proposal, st):
            int(proposal.confidence.argmax())
            return super().select(canvas, plan, proposal, st)

    canvas = Canvas.from_prompts([[5, 6, 7]], GEN, int(tiny_llada.config.mask_token_id), 0)
    timer = ModelTimer(tiny_llada)
    with SyncCounter(timer) as counter:
        decode(timer, canvas, Chatty(Chatty.Config(block_length=8), GEN))
    assert counter.total > canvas.step + SETUP and counter.counts.get("__int__", 0) == canvas.step


def test_the_counter_sees_mask_indexing_and_counts_ops_outside_the_model(tiny_llada):
    """Boolean-mask indexing and assignment count as syncs (seen where they reach ATen), and so do tensors made from host
    lists (a copy the host waits for on a GPU); ``ops`` counts the tensor operations outside the model only; leaving the counter restores torch (a 0-d tensor inside a list still converts)."""
    x = torch.arange(6)
    with torch.inference_mode(), SyncCounter() as c:
        x[x > 2]
        x[1:3]
        x[torch.tensor([0, 1])]
        y = x.clone()
        y[y > 2] = 0
        y[torch.tensor([0])] = 1
        y[0] = 2                                   # a Python scalar: a kernel argument, no copy
    assert c.counts == {"mask-index": 2, "host-tensor": 2} and c.ops >= 3
    assert torch.tensor([[torch.tensor(0.5), 0.0]]).tolist() == [[0.5, 0.0]]

    ops = {}
    for timed in (True, False):
        canvas = Canvas.from_prompts([[5, 6, 7]], GEN, int(tiny_llada.config.mask_token_id), 0)
        timer = ModelTimer(tiny_llada) if timed else None
        with SyncCounter(timer) as counter:
            decode(timer or tiny_llada, canvas, strategy_class("threshold")(strategy_class("threshold").Config(block_length=8), GEN))
        ops[timed] = counter.ops / canvas.step
    assert 0 < ops[True] < 100 and ops[False] > 2 * ops[True]     # the model's ops are not counted


def test_host_numbers_reach_the_device_without_a_counted_sync():
    """``host_tensor`` (pinned, non-blocking on CUDA) is the one way per-step host numbers become tensors: same
    values as ``torch.tensor``, not counted; the plain call is."""
    from dlm_engine.core.devices import host_tensor

    with torch.inference_mode(), SyncCounter() as c:
        t = host_tensor([[1, 2], [3, 4]], torch.long, "cpu")
        f = host_tensor([True, False], torch.bool, torch.device("cpu"))
    assert c.total == 0
    assert t.dtype == torch.long and t.tolist() == [[1, 2], [3, 4]] and f.tolist() == [True, False]
    with torch.inference_mode(), SyncCounter() as c:
        torch.tensor([1, 2])
    assert c.counts == {"host-tensor": 1}


def test_host_tensor_from_numpy_arrays_is_a_copy_with_torch_tensors_values():
    """A numpy array takes ``from_numpy`` on a copy (no per-element walk): the values, dtype and shape of
    ``torch.tensor``, not counted as a sync, never sharing memory with the array; a cast that could change values
    (int to bool, float to int) goes through ``torch.tensor``, which decides it as before."""
    from dlm_engine.core.devices import host_tensor

    cases = [(np.array([[1, 2], [3, 4]]), torch.long), (np.array([True, False]), torch.bool),
             (np.array([True, False]), torch.long), (np.array([1, 2], dtype=np.int32), torch.long),
             (np.array([[0.5, -1.25]]), torch.float64), (np.array([0.5], dtype=np.float32), torch.float64),
             (np.array([3, 0, -2]), torch.bool), (np.array([1.75, -2.5]), torch.long),
             (np.stack([np.arange(3), np.arange(3)])[:, ::2], torch.long), (np.zeros((0, 3), np.int64), torch.long)]
    for arr, dtype in cases:
        with torch.inference_mode(), SyncCounter() as c:
            t = host_tensor(arr, dtype, "cpu")
        assert c.total == 0
        ref = torch.tensor(arr, dtype=dtype)
        assert t.dtype == ref.dtype and t.shape == ref.shape and torch.equal(t, ref), (arr, dtype)
        if arr.size:
            before = t.clone()
            arr.flat[0] = 7                          # (writes to the array do not reach the tensor)
            assert torch.equal(t, before)


@pytest.mark.parametrize("capture", ["default", "confidence"])
def test_recording_adds_no_host_sync_on_the_step_loop(tiny_llada, tmp_path, capture):
    """Issue 17, item 4: the recorder's sink only hands references to its writer thread; the writer's own host
    copies happen on its thread, which the counter leaves out (it counts the thread that entered it)."""
    from dlm_engine.trace import TraceRecorder, open_trace

    header = {"model": {"eos_id": 2, "mask_id": int(tiny_llada.config.mask_token_id)}, "tokenizer": {"kind": "char"}}
    counts = {}
    for record in (False, True):
        cls = strategy_class("threshold")
        canvas = Canvas.from_prompts(PROMPTS[3], GEN, int(tiny_llada.config.mask_token_id), 0)
        timer = ModelTimer(tiny_llada)
        path = tmp_path / f"r{capture}.dlmt"
        rec = TraceRecorder(str(path), header, **({} if capture == "default" else {"capture": capture})) if record else None
        with SyncCounter(timer) as counter:
            decode(timer, canvas, cls(cls.Config(block_length=8), GEN), sinks=[rec.sink(0, [0, 1, 2])] if rec else ())
        if rec is not None:
            rec.close()
            tr = open_trace(str(path), recover=False)                 # the writer did its work
            assert tr.ok and len(tr) == 3
        counts[record] = (dict(counter.counts), canvas.step)
    assert counts[True] == counts[False]


@pytest.mark.cuda
@pytest.mark.parametrize("name, kw, cache", [("d2c", {"block_length": 8, "threshold": 0.5}, "prefix"),
                                             ("d2c", {"block_length": 8, "threshold": 0.5}, "dual"),
                                             ("klass", {"block_length": 8, "threshold": 0.5}, "d2cache"),
                                             ("low_confidence", {"block_length": 8}, "dual")])
def test_cached_decode_with_rows_sitting_out_matches_the_cpu_on_cuda(tiny_llada, name, kw, cache):
    """A padded batch whose rows sit steps out (their block is done) through a stored cache: the cache finds the
    call's rows among the rows it holds on the rows' device (a CPU ``arange`` there failed every such call on a
    GPU); at T = 0 the tokens are the CPU's."""
    out = {}
    for dev in ("cpu", "cuda"):
        model = tiny_llada.to(dev)
        canvas = Canvas.from_prompts(PROMPTS[3], GEN, int(model.config.mask_token_id), 0, device=dev)
        cls = strategy_class(name)
        decode(model, canvas, cls(cls.Config(**kw), GEN), batch_cache(cache))
        out[dev] = canvas.tokens.cpu().tolist()
    tiny_llada.to("cpu")
    assert out["cpu"] == out["cuda"]


@pytest.mark.cuda
def test_host_tensor_on_cuda_and_a_decode_matches_the_cpu(tiny_llada):
    """The pinned, non-blocking path of ``host_tensor`` gives the values, and a decode with per-row host numbers
    (a padded batch: row indices, counts) matches the CPU one token for token."""
    from dlm_engine.core.devices import host_tensor

    t = host_tensor([[1, 2], [3, 4]], torch.long, "cuda")
    assert t.device.type == "cuda" and t.tolist() == [[1, 2], [3, 4]]
    out = {}
    for dev in ("cpu", "cuda"):
        model = tiny_llada.to(dev)
        canvas = Canvas.from_prompts(PROMPTS[3], GEN, int(model.config.mask_token_id), 0, device=dev)
        cls = strategy_class("threshold")
        decode(model, canvas, cls(cls.Config(block_length=8), GEN))
        out[dev] = canvas.tokens.cpu().tolist()
    tiny_llada.to("cpu")
    assert out["cpu"] == out["cuda"]


CUDA = pytest.mark.cuda


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), pytest.param("cuda", "float32", marks=CUDA),
                                           pytest.param("cuda", "bfloat16", marks=CUDA)])
@pytest.mark.parametrize("capture", ["default", "confidence", "topk"])
@pytest.mark.parametrize("name, kw", [("threshold", {"block_length": 8}), ("wino", {"block_length": 8}),
                                      ("block_buffer", {"block_length": 4}), ("klass", {"block_length": 8,
                                                                                        "threshold": 0.5})])
def test_recorder_reads_back_the_decode(tmp_path, device, dtype, capture, name, kw):
    """A padded batch whose rows sit steps out, recorded (on CUDA: events, the side stream's host copies): the
    trace read back holds the decode's tokens and commit steps, one step record per step, captured top-k logits
    of the committed positions (strategies that sample themselves hand over their call rows' logits only), and
    recording adds no host sync on the step loop's thread."""
    from conftest import REFPARITY
    from dlm_engine.models.loader import load_pretrained
    from dlm_engine.trace import TraceRecorder, open_trace

    model = load_pretrained(REFPARITY / "tiny_llada", device=device, dtype=dtype)[0]
    mask = int(model.config.mask_token_id)
    header = {"model": {"eos_id": 2, "mask_id": mask}, "tokenizer": {"kind": "char"}}
    counts = {}
    for record in (False, True):
        cls = strategy_class(name)
        canvas = Canvas.from_prompts(PROMPTS[3], GEN, mask, 0, device=device)
        timer = ModelTimer(model)
        path = tmp_path / f"{record}.dlmt"
        rec = TraceRecorder(str(path), header, **({} if capture == "default" else {"capture": capture})) if record else None
        log = RecordingSink()
        with SyncCounter(timer) as counter:
            decode(timer, canvas, cls(cls.Config(**kw), GEN), sinks=[rec.sink(0, [0, 1, 2]), log] if rec else ())
        counts[record] = (dict(counter.counts), canvas.step)
        if rec is not None:
            rec.close()
            tr = open_trace(str(path), recover=False)
            assert tr.ok and len(tr) == 3 and len(tr.batches[0].steps) == canvas.step
            # the step table holds every delta's rows and per-row scalars (fetched from the device in runs)
            tab, ds = tr.batches[0].steps, [d for d in log.deltas if d.step > 0]
            for field in ("active", "finished"):
                assert np.array_equal(getattr(tab, field), np.stack([getattr(d, field).cpu().numpy() for d in ds]))
            rowwise = [k for k, v in ds[0].scalars.items() if isinstance(v, torch.Tensor) and v.shape == (3,)]
            assert rowwise or name == "klass"
            for k in rowwise:
                want = np.stack([d.scalars[k].cpu().float().numpy() for d in ds]).astype(np.float64)
                assert np.array_equal(np.asarray(tab.scalars[k], dtype=np.float64), want, equal_nan=True), k
            if capture == "confidence":          # each position's confidence at the step that committed it
                conf = np.full((3, canvas.length), np.nan, dtype=np.float32)
                for d in ds:
                    c, m = d.confidence.cpu().float().numpy(), d.commit.cpu().numpy()
                    np.copyto(conf[:, d.start:d.start + m.shape[1]], c, where=m)
                conf = conf.astype(np.float16).astype(np.float32)      # (stored as float16)
                for i in range(3):
                    assert np.array_equal(tr[i].confidence, conf[i, canvas.gen_start:], equal_nan=True)
            g = canvas.gen_start
            for i in range(3):
                assert tr[i].tokens.tolist() == canvas.tokens[i, g:].tolist()
                assert tr[i].step_of.tolist() == canvas.step_of[i, g:].tolist()
                if capture == "topk":            # at T = 0 the committed token is the top-1 id of its step's logits
                    cols, ids, _ = tr[i].topk
                    committed = canvas.step_of[i, g:].cpu() >= 1
                    assert ids.shape == (int(committed.sum()), 5)
                    if device == "cpu":             # (exact ties may break differently on a GPU)
                        assert ids[:, 0].tolist() == canvas.tokens[i, g:].cpu()[committed].tolist()
    assert counts[True] == counts[False]


class FakeEvent:
    """A stand-in for ``torch.cuda.Event`` on a CPU: counts how many are made and recorded, and fails when one is
    recorded again before the writer waited on it, or is back in the recorder's pool before that wait."""
    made = recorded = 0
    pools: dict = {}

    def __init__(self):
        FakeEvent.made += 1
        self.device, self.pending = None, False

    def record(self, stream=None):
        assert stream is not None, "the sink records on the stream it took at on_start"
        assert not self.pending, "an event recorded again before the writer waited on it"
        FakeEvent.recorded += 1
        self.device, self.pending = stream.device, True

    def synchronize(self):
        assert self.pending, "the writer waits once per record"
        assert not any(e is self for pool in FakeEvent.pools.values() for e in pool), \
            "an event back in the pool before the writer waited on it"
        self.pending = False


class FakeStream:
    device = torch.device("cuda", 0)


class CudaLooking:
    """A CPU canvas that tells ``on_start`` it is on CUDA (everything else is the canvas')."""

    device = torch.device("cuda", 0)

    def __init__(self, canvas):
        self._canvas = canvas

    def __getattr__(self, name):
        return getattr(self._canvas, name)


@pytest.mark.parametrize("threaded", [False, True])
def test_the_sinks_reuse_cuda_events_the_writer_has_waited_on(tiny_llada, tmp_path, monkeypatch, threaded):
    """A CUDA sink records an event a step for the writer to wait on; an event the writer has waited on goes back
    to the recorder's pool and is recorded again, so a step costs the loop a record, not a create as well (a CPU
    decode whose sinks take the CUDA path of ``on_start`` with a stand-in event and stream; the CUDA tests above run
    real ones). With the writer on the caller's thread every event is back before the next step: one event for the
    whole decode; with the writer thread, the second batch reuses what the first one's waits gave back."""
    from dlm_engine.trace import TraceRecorder, open_trace
    from dlm_engine.trace.recorder import BatchSink

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(FakeEvent, "made", 0)
    monkeypatch.setattr(FakeEvent, "recorded", 0)
    start = BatchSink.on_start
    monkeypatch.setattr(BatchSink, "on_start", lambda self, canvas, info: start(self, CudaLooking(canvas), info))
    mask = int(tiny_llada.config.mask_token_id)
    header = {"model": {"eos_id": 2, "mask_id": mask}, "tokenizer": {"kind": "char"}}
    rec = TraceRecorder(str(tmp_path / "t.dlmt"), header, threaded=threaded)
    monkeypatch.setattr(FakeEvent, "pools", rec._spare_events)
    cls = strategy_class("low_confidence")
    steps = 0
    for b in range(2):
        canvas = Canvas.from_prompts(PROMPTS[3], GEN, mask, 0)
        sink = rec.sink(b, [3 * b, 3 * b + 1, 3 * b + 2])
        decode(tiny_llada, canvas, cls(cls.Config(block_length=8, steps=GEN), GEN), sinks=[sink])
        assert sink._cuda and sink._spare is rec._spare_events[0]       # (on_start's CUDA branch ran)
        steps += canvas.step
    rec.close()
    assert FakeEvent.recorded == steps + 4           # each batch's begin, a delta's each step, each batch's end
    assert FakeEvent.made == 1 if not threaded else 1 <= FakeEvent.made < FakeEvent.recorded
    assert open_trace(str(tmp_path / "t.dlmt"), recover=False).ok


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_writer_replay_of_captured_items_writes_the_same_trace(tmp_path, device, monkeypatch):
    """What a decode's sinks hand over, captured and replayed into ``TraceRecorder(threaded=False)`` (the writer
    bench's replay: no sink, so no ``on_start`` tells the recorder the tensors' device) writes the very bytes the
    threaded recorder wrote during the decode; on CUDA the replay must copy the device tensors to the host."""
    import time

    from conftest import REFPARITY
    from dlm_engine.models.loader import load_pretrained
    from dlm_engine.trace import TraceRecorder, open_trace

    model = load_pretrained(REFPARITY / "tiny_llada", device=device, dtype="float32")[0]
    mask = int(model.config.mask_token_id)
    header = {"model": {"eos_id": 2, "mask_id": mask}, "tokenizer": {"kind": "char"}}
    cls = strategy_class("threshold")
    canvas = Canvas.from_prompts(PROMPTS[3], GEN, mask, 0, device=device)
    # the end record holds the whole second each recorder closed in: one clock for both, or the two files differ
    # whenever a second ticks between the closes
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)
    rec = TraceRecorder(str(tmp_path / "live.dlmt"), header)
    items, put = [], rec._put
    rec._put = lambda item, urgent=False: items.append(item) or put(item, urgent)
    decode(model, canvas, cls(cls.Config(block_length=8), GEN), sinks=[rec.sink(0, [0, 1, 2])])
    rec.close()
    again = TraceRecorder(str(tmp_path / "replayed.dlmt"), header, threaded=False)
    for item in items:
        again._put(item)
    again.close()
    assert any(isinstance(t, torch.Tensor) and t.device.type == device for t in items[0])
    assert (tmp_path / "live.dlmt").read_bytes() == (tmp_path / "replayed.dlmt").read_bytes()
    tr = open_trace(str(tmp_path / "replayed.dlmt"), recover=False)
    assert [tr[i].tokens.tolist() for i in range(3)] == canvas.tokens[:, canvas.gen_start:].tolist()


def test_model_info_is_read_once_per_model_and_decode_sets_it(tiny_llada):
    """``ModelInfo.of`` remembers each model's info (every decode asks; a config read costs microseconds): the
    same values as reading the config, per model object; objects that cannot be weakly referenced are read each
    time; a decode gives the canvas its model's info."""
    import types

    from dlm_engine.core.canvas import NO_MODEL_INFO

    info = ModelInfo.of(tiny_llada)
    assert info == ModelInfo(tiny_llada.config.model_type, 0) and ModelInfo.of(tiny_llada) is info

    class Slotted:
        __slots__ = ("config", "logits_shift")

    for i, shift in enumerate((1, 0)):
        m = Slotted()
        m.config, m.logits_shift = types.SimpleNamespace(model_type=f"kind{i}"), shift
        assert ModelInfo.of(m) == ModelInfo(f"kind{i}", shift)
    other = ModelTimer(tiny_llada)
    other.config = types.SimpleNamespace(model_type="Dream")          # a wrapper is a model object of its own
    other.logits_shift = 1
    assert ModelInfo.of(other) == ModelInfo("Dream", 1) and ModelInfo.of(tiny_llada) is info
    canvas = Canvas.from_prompts(PROMPTS[1], GEN, int(tiny_llada.config.mask_token_id), 0)
    assert canvas.model_info is NO_MODEL_INFO
    cls = strategy_class("threshold")
    decode(tiny_llada, canvas, cls(cls.Config(block_length=8), GEN))
    assert canvas.model_info is info


def test_decode_refuses_a_batch_larger_than_the_strategys_max_batch(tiny_llada):
    """CadLLM adapts its blocks per sequence (``max_batch = 1``; the API splits batches): a wider canvas handed to the
    loop directly is a clear error, not a decode whose host decisions follow row 0 only."""
    cls = strategy_class("cadllm")
    canvas = Canvas.from_prompts(PROMPTS[3], GEN, int(tiny_llada.config.mask_token_id), 0)
    with pytest.raises(ValueError, match=r"strategy 'cadllm' decodes at most 1 row\(s\) at a time \(max_batch\)"):
        decode(tiny_llada, canvas, cls(cls.Config(initial_block_length=8, min_block=4, max_block=8), GEN))
    assert canvas.step == 0
    one = Canvas.from_prompts(PROMPTS[1], GEN, int(tiny_llada.config.mask_token_id), 0)
    decode(tiny_llada, one, cls(cls.Config(initial_block_length=8, min_block=4, max_block=8), GEN))
    assert not one.masked()[:, one.gen_start:].any()
