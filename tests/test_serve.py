"""dlm-serve: a real server on 127.0.0.1 (in this process, or a subprocess for the command and SIGTERM): the OpenAI
endpoints and clients, per-request options validated as `dlm` validates overrides, batching that changes no
answer, streams of text and steps, traces, and the faults (full queue, disconnect, timeout, bad input, SIGTERM)."""
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from conftest import BIN, need

need("starlette", "serve")
need("uvicorn", "serve")
need("sse_starlette", "serve")
httpx = need("httpx", "dev")

import dlm_engine  # noqa: E402
from dlm_engine.serve.cli import ServerThread  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["347+085=", "901-256=", "name a fruit:", "sum 9:"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve")
    with ServerThread(["device=cpu", "max_batch_wait=0.3", "max_batch_size=8", "queue_size=6",
                       "trace.record=true"], out) as s:
        s.client = httpx.Client(base_url=s.url, timeout=60)
        yield s
        s.client.close()


@pytest.fixture(scope="module")
def session():
    return dlm_engine.Session(model="tiny", device="cpu")


def post(s, body, path="/v1/completions"):
    return s.client.post(path, json=body)


def concurrently(fn, items):
    out = [None] * len(items)

    def one(i, x):
        out[i] = fn(x)

    ts = [threading.Thread(target=one, args=(i, x)) for i, x in enumerate(items)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return out


def test_completion_models_health_and_metrics(srv):
    r = post(srv, {"model": "tiny", "prompt": "347+085=", "max_tokens": 16})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "0432"
    assert body["choices"][0]["finish_reason"] == "stop"
    u = body["usage"]
    assert u["completion_tokens"] == 5 and u["prompt_tokens"] == 8 and u["total_tokens"] == 13
    assert r.headers["x-request-id"] == body["dlm"]["request_id"]
    # the server's own figures: its time from arrival to the answer, and that time less the decode
    choice, top = body["choices"][0]["dlm"], body["dlm"]
    assert 0 < top["server_time"] <= r.elapsed.total_seconds()
    assert top["server_time"] >= choice["queue_wait"] + choice["decode_time"] > 0
    assert top["overhead"] == pytest.approx(top["server_time"] - choice["decode_time"], abs=1e-9)
    two = post(srv, {"prompt": ["347+085=", "901-256="]}).json()      # an array of prompts: a choice each
    assert [c["index"] for c in two["choices"]] == [0, 1] and two["choices"][0]["text"] == "0432"
    assert two["usage"]["completion_tokens"] == sum(c["dlm"]["generated_tokens"] for c in two["choices"])
    assert srv.client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert srv.client.get("/health").json()["status"] == "ok"
    text = srv.client.get("/metrics").text
    for name in ("dlm_requests_total{", "dlm_queue_depth", "dlm_batch_size_bucket", "dlm_generated_tokens_total",
                 "dlm_nfe_total", "dlm_tpf_bucket", "dlm_request_latency_seconds_bucket"):
        assert name in text, name


def test_bad_options_are_400_one_line_naming_the_key_and_the_server_goes_on(srv):
    from dlm_engine.core.capabilities import incompatibility
    from dlm_engine.core.registry import CACHES, strategy_class

    cases = [({"strategy": "threshold", "treshold": 0.8}, "dlm.treshold: unknown key; did you mean dlm.threshold?"),
             ({"strategy": "treshold"}, "strategy=treshold: no such strategy"),
             ({"strategy": "threshold", "block_length": 5}, "not divisible by strategy.block_length=5"),
             ({"strategy": "low_confidence", "steps": -3}, "strategy.steps"),
             ({"strategy": {"name": "threshold", "threshold": "high"}}, "strategy.threshold"),
             ({"model.path": "/x"}, "dlm.model.path: a request sets strategy.* and cache.* options only")]
    S = strategy_class("factor")
    bad = next(c for c, cls in CACHES.items() if incompatibility(S(S.Config(), 16), cls()) is not None)
    cases.append(({"strategy": "factor", "cache": bad}, f"cache={bad}"))
    for options, want in cases:
        r = post(srv, {"prompt": "12+34=", "dlm": options})
        assert r.status_code == 400, (options, r.text)
        msg = r.json()["error"]["message"]
        assert want in msg and "\n" not in msg, (options, msg)
    assert post(srv, {"prompt": "12+34=", "top_p": 0.5, "dlm": {"strategy": "threshold"}}).json()[
        "error"]["message"].startswith("top_p=0.5: strategy=threshold has no top_p option")
    assert post(srv, {"prompt": "347+085="}).json()["choices"][0]["text"] == "0432"


@pytest.mark.parametrize("body, status, want", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (json.dumps({"prompt": 5}).encode(), 400, "prompt: expected a string"),
    (json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(), 400, "max_tokens: expected an integer"),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "stream: expected a boolean"),
    (json.dumps({"prompt": "x", "max_tokens": 100}).encode(), 400, "max_tokens: gen_length=100 is more than model"),
    (json.dumps({"prompt": "1" * 60}).encode(), 400, "prompt 0 has 60 tokens: with max_tokens=16"),
    (json.dumps({"prompt": "x" * 200000}).encode(), 400, "max_prompt_chars"),
    (json.dumps({"prompt": "x", "logprobs": 3}).encode(), 400, "logprobs: not supported"),
    (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), 404, "model 'gpt-4' is not served"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400, "chat template"),
])
def test_malformed_requests_get_one_line_4xx_then_the_next_is_served(srv, body, status, want):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = srv.client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert want in msg and "\n" not in msg, msg
    assert post(srv, {"prompt": "347+085="}).json()["choices"][0]["text"] == "0432"


CASES = [("threshold", "dual", {"block_length": 8, "threshold": 0.7}),
         ("low_confidence", "prefix", {"block_length": 8, "steps": 8}),
         ("factor", "none", {"block_length": 8}),
         ("klass", "dual", {"block_length": 8, "threshold": 0.7})]


@pytest.mark.parametrize("name, cache, opts", CASES)
def test_batched_requests_equal_decoding_each_alone(srv, session, name, cache, opts):
    """Concurrent requests with the same settings share a decode; each answer's tokens, NFE and commit steps
    equal the Python API (= `dlm`) decoding that prompt alone."""
    dlm = dict(opts, strategy=name, cache=cache)
    post(srv, {"prompt": "1+1=", "dlm": dlm})           # composes these settings once (a compose takes a while)
    outs = concurrently(lambda p: post(srv, {"prompt": p, "dlm": dlm}).json(), PROMPTS)
    assert max(o["choices"][0]["dlm"]["batch_size"] for o in outs) > 1, "the requests were never batched"
    for p, o in zip(PROMPTS, outs):
        alone = session.generate([p], strategy=name, cache=cache, batch_size=1,
                                 **{f"strategy.{k}": v for k, v in opts.items()})[0]
        got = o["choices"][0]
        assert (got["text"], got["dlm"]["tokens"], got["dlm"]["nfe"], got["dlm"]["commit_step"]) == \
            (alone.text, alone.tokens, alone.nfe, alone.step_of), (name, cache, p)


def test_requests_whose_settings_differ_are_batched_apart(srv):
    bodies = [{"prompt": p, "dlm": {"strategy": "threshold", "threshold": t}} for p in PROMPTS[:2] for t in (0.5, 0.9)]
    outs = concurrently(lambda b: post(srv, b).json(), bodies)
    for b, o in zip(bodies, outs):
        d = o["choices"][0]["dlm"]
        assert d["batch_size"] <= 2 and d["strategy"] == "threshold"
    # an interacting pair (block_buffer + dual) is decoded one request at a time
    bb = {"strategy": "block_buffer", "cache": "dual", "block_length": 4}
    outs = concurrently(lambda p: post(srv, {"prompt": p, "dlm": bb}).json(), PROMPTS[:3])
    assert all(o["choices"][0]["dlm"]["batch_size"] == 1 for o in outs)


def sse(s, body, path="/v1/completions"):
    """(events, data items) of a streamed request: events are (event name, parsed data)."""
    events = []
    with s.client.stream("POST", path, json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                events.append((name, data if data == "[DONE]" else json.loads(data)))
                name = None
    return events


def test_stream_sends_the_growing_prefix_and_step_events(srv):
    dlm = {"strategy": "low_confidence", "steps": 16, "stream_steps": True}
    plain = post(srv, {"prompt": "347+085=", "dlm": {"strategy": "low_confidence", "steps": 16}}).json()
    events = sse(srv, {"prompt": "347+085=", "dlm": dlm, "stream_options": {"include_usage": True}})
    assert events[-1] == (None, "[DONE]")
    steps = [d for n, d in events if n == "dlm.step"]
    chunks = [d for n, d in events if n is None and d != "[DONE]" and d["choices"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    got = plain["choices"][0]
    assert text == got["text"] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert len([c for c in chunks if c["choices"][0]["text"]]) >= 2          # text arrived as it was committed
    assert [s["step"] for s in steps] == list(range(1, got["dlm"]["steps"] + 1))
    assert steps[-1]["nfe"] == got["dlm"]["nfe"] and steps[-1]["commit_step"] == got["dlm"]["commit_step"]
    assert steps[0]["masked"] == 15 and steps[0]["tokens"].count(-1) == 15
    assert [d for n, d in events if n is None and d != "[DONE]" and not d["choices"]][0]["usage"][
        "completion_tokens"] == plain["usage"]["completion_tokens"]


def test_step_events_show_remasks(srv):
    """WINO re-masks committed tokens: the step events say where, and the canvas shows the mask again."""
    events = sse(srv, {"prompt": "name a fruit:", "max_tokens": 16,
                       "dlm": {"strategy": "wino", "block_length": 8, "stream_steps": True}})
    steps = [d for n, d in events if n == "dlm.step"]
    remasks = [(s["step"], p) for s in steps for p in s["remasked"]]
    for step, p in remasks:
        assert steps[step - 1]["tokens"][p] == -1 and steps[step - 1]["commit_step"][p] == -1
    text = "".join(d["choices"][0]["text"] for n, d in events if n is None and d != "[DONE]" and d["choices"])
    assert text == post(srv, {"prompt": "name a fruit:", "dlm": {"strategy": "wino", "block_length": 8}}).json()[
        "choices"][0]["text"]


def test_openai_client_plain_and_streaming(srv):
    openai = need("openai", "dev")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    c = client.completions.create(model="tiny", prompt="347+085=", max_tokens=16, temperature=0)
    assert c.choices[0].text == "0432" and c.usage.completion_tokens == 5
    parts = [ch.choices[0].text for ch in client.completions.create(model="tiny", prompt="347+085=", max_tokens=16,
                                                                    stream=True)]
    assert "".join(parts) == "0432"
    c = client.completions.create(model="tiny", prompt="347+085=", stop=["3"],
                                  extra_body={"dlm": {"strategy": "threshold", "threshold": 0.8}})
    assert c.choices[0].text == "04" and c.choices[0].finish_reason == "stop"


def test_traces_are_recorded_tagged_and_read_by_dlm_trace(srv, capsys, tmp_path):
    from dlm_engine.trace import open_trace
    from dlm_engine.trace.cli import main as trace_cli

    outs = concurrently(lambda p: post(srv, {"prompt": p, "dlm": {"strategy": "threshold"}}).json(), PROMPTS[:2])
    for o in outs:
        path = o["dlm"]["trace"]
        assert path and os.path.isfile(path) and path.endswith(".dlmt")
        tr = open_trace(path, recover=False)
        ids = tr.header["serve"]["requests"]
        row = ids.index(o["dlm"]["request_id"])
        seq = list(tr)[row]
        assert seq.text == o["choices"][0]["text"] and seq.nfe == o["choices"][0]["dlm"]["nfe"]
        assert trace_cli(["replay", path, "--json"]) == 0
        assert o["choices"][0]["text"] in capsys.readouterr().out
        assert trace_cli(["show", path]) == 0 and "threshold" in capsys.readouterr().out
        assert trace_cli(["verify", path]) == 0
        assert trace_cli(["html", path, "-o", str(tmp_path / "t.html")]) == 0 and (tmp_path / "t.html").is_file()


def test_full_queue_is_429_with_retry_after_and_accepted_requests_are_answered(srv):
    gate = threading.Event()
    srv.server.engine.step_hook = lambda step: gate.wait(60)
    try:
        results = []
        first = threading.Thread(target=lambda: results.append(post(srv, {"prompt": "347+085="})))
        first.start()
        for _ in range(200):                               # the first one decodes (held at its first step)
            if srv.server.engine.decoding:
                break
            time.sleep(0.01)
        bodies = [{"prompt": p, "dlm": {"strategy": "threshold"}} for p in PROMPTS * 2]
        ts = [threading.Thread(target=lambda b=b: results.append(post(srv, b))) for b in bodies]
        for t in ts:
            t.start()
        for _ in range(3000):                              # the two that do not fit are answered at once
            if len(results) >= 2:
                break
            time.sleep(0.01)
        gate.set()
        first.join(60)
        for t in ts:
            t.join(60)
    finally:
        srv.server.engine.step_hook = None
        gate.set()
    full = [r for r in results if r.status_code == 429]
    ok = [r for r in results if r.status_code == 200]
    assert full and len(ok) + len(full) == 9 and len(ok) >= 7      # queue_size=6 waiting + 1 decoding
    assert int(full[0].headers["retry-after"]) >= 1 and "queue is full" in full[0].json()["error"]["message"]
    assert all(r.json()["choices"][0]["text"] for r in ok)


def test_a_client_gone_mid_stream_frees_its_rows(srv):
    eng = srv.server.engine
    before = eng.metrics.freed._value.get(), eng.metrics.cancelled._value.get()
    body = {"prompt": "347+085=", "stream": True, "max_tokens": 48,
            "dlm": {"strategy": "low_confidence", "steps": 48, "stream_steps": True}}
    alone = post(srv, dict(body, stream=False, prompt="sum 9:"))      # (also composes these settings once)
    eng.step_hook = lambda step: time.sleep(0.03)
    try:
        other = []
        t = threading.Thread(target=lambda: other.append(post(srv, dict(body, stream=False, prompt="sum 9:"))))
        t.start()
        with srv.client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("event: dlm.step"):
                    break                                  # gone after the first step
        t.join(60)
        for _ in range(300):
            if eng.metrics.freed._value.get() > before[0]:
                break
            time.sleep(0.01)
    finally:
        eng.step_hook = None
    assert eng.metrics.freed._value.get() == before[0] + 1
    assert other[0].json()["choices"][0]["dlm"]["batch_size"] == 2
    assert other[0].json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    # a batch whose every client is gone stops
    eng.step_hook = lambda step: time.sleep(0.03)
    try:
        with srv.client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("event: dlm.step"):
                    break
        for _ in range(300):
            if eng.metrics.cancelled._value.get() > before[1]:
                break
            time.sleep(0.01)
    finally:
        eng.step_hook = None
    assert eng.metrics.cancelled._value.get() == before[1] + 1
    # a client that gives up on a plain (not streamed) request frees it too (checked every second)
    eng.step_hook = lambda step: time.sleep(0.05)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/v1/completions", json=dict(body, stream=False), timeout=0.5)   # (closed after)
        for _ in range(600):
            if eng.metrics.cancelled._value.get() > before[1] + 1:
                break
            time.sleep(0.01)
    finally:
        eng.step_hook = None
    assert eng.metrics.cancelled._value.get() == before[1] + 2


def test_request_timeout_is_504_and_the_server_goes_on(srv):
    srv.server.timeout, eng = 0.3, srv.server.engine
    eng.step_hook = lambda step: time.sleep(0.05)
    try:
        r = post(srv, {"prompt": "347+085=", "max_tokens": 32, "dlm": {"strategy": "low_confidence", "steps": 32}})
    finally:
        srv.server.timeout, eng.step_hook = 300.0, None
    assert r.status_code == 504 and "timed out after request_timeout=0.3 s" in r.json()["error"]["message"]
    assert post(srv, {"prompt": "347+085="}).json()["choices"][0]["text"] == "0432"


def test_chat_uses_the_checkpoint_chat_template(tmp_path, session):
    import shutil

    from dlm_engine.checkpoints import embedded_path

    ck = tmp_path / "ck"
    shutil.copytree(embedded_path("tiny"), ck)
    tc = json.loads((ck / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}a:"
    (ck / "tokenizer_config.json").write_text(json.dumps(tc))
    msgs = [{"role": "user", "content": "347+085="}]
    with ServerThread(["device=cpu", "model=local", f"model.path={ck}", "model.chat_template=on"], tmp_path) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json={"model": "local", "messages": msgs})
            streamed = []
            with c.stream("POST", "/v1/chat/completions", json={"messages": msgs, "stream": True}) as st:
                for line in st.iter_lines():
                    if line.startswith("data:") and "[DONE]" not in line:
                        streamed.append(json.loads(line[5:]))
    assert r.status_code == 200, r.text
    body = r.json()
    ref = dlm_engine.Session(model="local", device="cpu", **{"model.path": str(ck), "model.chat_template": "on"})
    alone = ref.generate([{"messages": msgs}], strategy="low_confidence", cache="none")[0]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant",
                                                                                       "content": alone.text}
    assert body["usage"]["prompt_tokens"] == len(ref.lm.tokenizer("u:347+085=\na:")["input_ids"])
    assert streamed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in streamed) == alone.text


def test_the_command_serves_and_sigterm_drains(tmp_path):
    """`dlm-serve` with no model arguments serves the embedded model; SIGTERM lets requests in flight finish and
    leaves every trace file closed intact."""
    import socket

    from dlm_engine.trace import open_trace

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([str(BIN / "dlm-serve"), f"port={port}", "device=cpu", "trace.record=true",
                             f"hydra.run.dir={tmp_path / 'run'}", "max_batch_wait=0.05"], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
            assert proc.poll() is None, proc.stderr.read()
        body = {"prompt": "347+085=", "max_tokens": 48, "dlm": {"strategy": "low_confidence", "steps": 48}}
        results = []
        ts = [threading.Thread(target=lambda: results.append(httpx.post(url + "/v1/completions", json=body,
                                                                       timeout=60))) for _ in range(3)]
        for t in ts:
            t.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        for t in ts:
            t.join(60)
        assert proc.wait(60) in (0, -signal.SIGTERM)     # (uvicorn re-raises the signal once it has drained)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(results) == 3 and all(r.status_code in (200, 503) for r in results)
    assert any(r.status_code == 200 for r in results)
    traces = sorted((tmp_path / "run" / "traces").iterdir())
    assert traces and not [t for t in traces if t.name.endswith(".partial")]
    for t in traces:
        assert open_trace(str(t), recover=False).end["status"] == "complete"


def test_bad_command_line_is_one_line(tmp_path):
    from conftest import run_dlm

    p = run_dlm(["strategy=treshold", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, exe="dlm-serve", timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "dlm-serve: error: strategy=treshold: no such strategy (choose from " + p.stderr.split("(choose from ")[1].strip()]
    assert not (tmp_path / "run").exists()
    from dlm_engine.errors import ConfigError
    from dlm_engine.serve.cli import build_server, compose_serve

    for bad, want in (("max_batch_size=0", "max_batch_size=0 must be a positive integer"),
                      ("request_timeout=0", "request_timeout=0.0 must be a positive number of seconds"),
                      ("port=70000", "port=70000 is outside 0..65535")):
        with pytest.raises(ConfigError, match=want):
            build_server(compose_serve([bad]), tmp_path, [bad])


def test_lm_eval_local_completions_scores_as_dlm_lm_eval_in_process(tmp_path, monkeypatch):
    """lm-eval's OpenAI-protocol client (`local-completions`) against the server gives the same generations and
    score as the in-process adapter (`dlm-lm-eval`) on a small local generate_until task."""
    need("lm_eval", "eval")
    from conftest import EXACT_MATCH_TASK, write_lm_eval_task
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = [{"prompt": "347+085=", "answer": "0432"}, {"prompt": "901-256=", "answer": "645"},
            {"prompt": "name a fruit:", "answer": "plum"}, {"prompt": "sum 9:", "answer": "2+7"}]
    (tmp_path / "task").mkdir()
    task_dir = write_lm_eval_task(tmp_path / "task", "dlm_serve_tiny", docs, EXACT_MATCH_TASK)
    settings = ["model=tiny", "strategy=threshold", "strategy.block_length=8", "gen_length=8", "device=cpu"]
    tm = TaskManager(include_path=str(task_dir))
    local = simple_evaluate(model="dlm_engine", model_args=",".join(settings + ["trace.record=false"]),
                            tasks=["dlm_serve_tiny"], task_manager=tm, log_samples=True)
    with ServerThread(settings, tmp_path) as s:
        served = simple_evaluate(model="local-completions", tasks=["dlm_serve_tiny"], task_manager=tm,
                                 log_samples=True, model_args=f"base_url={s.url}/v1/completions,model=tiny,"
                                 "tokenizer_backend=None,tokenized_requests=False,num_concurrent=2,max_retries=1")
    resp = lambda res: [x["resps"] for x in sorted(res["samples"]["dlm_serve_tiny"], key=lambda x: x["doc_id"])]  # noqa
    assert resp(served) == resp(local) and any(r[0][0] for r in resp(local))
    assert served["results"]["dlm_serve_tiny"]["exact_match,none"] == \
        local["results"]["dlm_serve_tiny"]["exact_match,none"]


def test_every_strategy_and_cache_batched_by_the_engine_equals_decoding_alone(srv):
    """The decode worker, for every compatible strategy/cache pair (the settings of the batch-invariance tests):
    prompts submitted together come back with the tokens, NFE and commit steps of `dlm`'s path decoding each alone
    (run_prompts, batch size 1). Pairs whose rows interact are decoded one request at a time by the server."""
    server, eng = srv.server, srv.server.engine
    ids = [server.lm.encode(p) for p in PROMPTS[:3]]
    checked, wait = 0, eng.max_wait
    eng.max_wait = 0.0             # (the prompts of a pair are submitted together: no need to wait for more)
    try:
        check_pairs(server, eng, ids)
    finally:
        eng.max_wait = wait


GREEDY = {"sdar": {"top_k": 1}}       # SDAR samples by default (no greedy mode): top-1 is its greedy decode


def check_pairs(server, eng, ids):
    from test_batch_invariance import SETTINGS

    from dlm_engine.app.api import run_prompts
    from dlm_engine.app.run import build_cache, build_strategy
    from dlm_engine.core.capabilities import incompatibility
    from dlm_engine.core.registry import CACHES, STRATEGIES, strategy_class
    from dlm_engine.serve.config import batch_key
    from dlm_engine.serve.engine import Request

    checked, batched = 0, 0
    for name in STRATEGIES.names():
        cls = strategy_class(name)
        opts = dict(SETTINGS.get(name, {}), **GREEDY.get(name, {}))
        for cache, ccls in CACHES.items():
            if incompatibility(cls(cls.Config(**opts), 16), ccls()) is not None:
                continue
            cfg = server.configs.get({"strategy": name, "cache": cache, "gen_length": 16,
                                      **{f"strategy.{k}": v for k, v in opts.items()}})
            got, done = {}, threading.Event()

            def emit(kind, payload, i):
                if kind in ("done", "error"):
                    got[i] = payload
                    if len(got) == len(ids):
                        done.set()

            eng.submit([Request(id=f"{name}-{cache}-{i}", cfg=cfg, key=batch_key(cfg), prompt_ids=x,
                                emit=lambda k, p, i=i: emit(k, p, i)) for i, x in enumerate(ids)])
            assert done.wait(120), (name, cache)
            alone = run_prompts(server.lm, ids, build_strategy(cfg), build_cache(cfg), 16, 1, warmup=False).rows
            for i, a in enumerate(alone):
                out = got[i]
                assert not isinstance(out, str), (name, cache, out)
                assert (out.row.tokens, out.row.nfe, out.row.step_of) == (a.tokens, a.nfe, a.step_of), (name, cache, i)
            checked += 1
            batched += max(o.batch_size for o in got.values()) > 1
    assert checked >= 30 and batched >= 20, (checked, batched)
