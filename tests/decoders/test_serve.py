"""`decoders.serve`: the OpenAI-compatible server, started in the test on a free loopback port.

The official `openai` client must get the tokens `decoders.load(...).generate` gives for the same
prompt (greedy), streaming and not; concurrent clients each get their own answer; every bad request
gets a 4xx with an OpenAI-style body and leaves the server healthy; a stream the client abandons
leaves no KV block or state slot in use; a full queue answers 503; every family serves; the
command line starts, serves, drains on SIGTERM and refuses bad options in one line; the serving
benchmark runs against the server over HTTP.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

import decoders
from decoders import serve
from eval.tokenizer import byte_tokenizer, save_tokenizer

PRESET = "llama-tiny"
CHAT_TEMPLATE = "{% for m in messages %}<bos>{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


def load(model):
    return decoders.load(model, device="cpu", impl="ref")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def metric(url: str, name: str, default: float | None = None) -> float:
    """One sample of a metric (`name` with its labels) read from /metrics; `default` when absent."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match or default is not None, f"{name} not in /metrics"
    return float(match.group(1)) if match else default


def concurrently(ask, n: int) -> None:
    """ask(0) .. ask(n - 1), each in its own thread, all at once; waits for every one (bounded)."""
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)


def settle(url: str, *names: str) -> None:
    """Wait (bounded) until every named gauge reads 0: the engine thread publishes its stats after
    the step whose outputs the client has already received."""
    for _ in range(200):
        if all(metric(url, name) == 0 for name in names):
            return
        threading.Event().wait(0.05)


@pytest.fixture(scope="module")
def preset_server():
    """(url, reference decoder) for a llama-tiny server: token-id prompts, no tokenizer."""
    with serve.running(load(PRESET), model_name=PRESET, max_batch=8) as url:
        yield url, load(PRESET)


@pytest.fixture(scope="module")
def recurrent_server():
    """(url, reference decoder) for a mamba2-tiny server: state slots instead of KV blocks."""
    with serve.running(load("mamba2-tiny"), model_name="mamba2-tiny", max_batch=4) as url:
        yield url, load("mamba2-tiny")


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A llama-tiny checkpoint folder with the byte-level tokenizer and a chat template."""
    folder = tmp_path_factory.mktemp("chat-model")
    load(PRESET).save(folder)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    save_tokenizer(tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def text_server(chat_folder):
    with serve.running(load(chat_folder), model_name="tiny-chat", max_batch=4) as url:
        yield url, load(chat_folder)


def test_completion_of_token_ids_matches_generate_streaming_and_not(preset_server):
    url, ref = preset_server
    prompt = [5, 17, 99, 3, 250, 41]
    expected = ref.generate([prompt], 12).tokens[0]
    api = client(url)
    reply = api.completions.create(model=PRESET, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.model_extra["token_ids"] == expected
    assert choice.text == " ".join(map(str, expected))
    assert choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 12)

    chunks = list(api.completions.create(model=PRESET, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks for choice in c.choices for t in choice.model_extra["token_ids"]]
    assert streamed == expected
    assert "".join(choice.text for c in chunks for choice in c.choices) == " ".join(map(str, expected))
    assert [choice.finish_reason for c in chunks for choice in c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_sixteen_concurrent_clients_each_get_their_own_answer(preset_server):
    url, ref = preset_server
    prompts = [[(7 * i + j) % 500 + 3 for j in range(3 + i % 5)] for i in range(16)]
    expected = [ref.generate([p], 8).tokens[0] for p in prompts]
    answers = [None] * len(prompts)

    def ask(i):
        reply = client(url).completions.create(model=PRESET, prompt=prompts[i], max_tokens=8, temperature=0,
                                               stream=i % 2 == 1, extra_body={"ignore_eos": True})
        if i % 2:
            answers[i] = [t for c in reply for choice in c.choices for t in choice.model_extra["token_ids"]]
        else:
            answers[i] = reply.choices[0].model_extra["token_ids"]

    concurrently(ask, len(prompts))
    assert answers == expected


def bad_requests(max_context: int):
    good = {"model": PRESET, "prompt": [1, 2, 3], "max_tokens": 4}
    return [
        ("malformed json", b'{"model": "llama-tiny", "prompt": [1, 2', 400),
        ("not an object", b"[1, 2, 3]", 400),
        ("missing prompt", {"model": PRESET, "max_tokens": 4}, 400),
        ("missing model", {"prompt": [1, 2, 3]}, 400),
        ("unknown model", {**good, "model": "gpt-9"}, 404),
        ("max_tokens 0", {**good, "max_tokens": 0}, 400),
        ("max_tokens negative", {**good, "max_tokens": -3}, 400),
        ("max_tokens not an int", {**good, "max_tokens": "many"}, 400),
        ("prompt over the context", {**good, "prompt": [1] * max_context}, 400),
        ("prompt + max_tokens over the context", {**good, "prompt": [1] * (max_context - 2), "max_tokens": 3}, 400),
        ("token id over the vocabulary", {**good, "prompt": [1, 512, 2]}, 400),
        ("negative token id", {**good, "prompt": [1, -1]}, 400),
        ("empty prompt", {**good, "prompt": []}, 400),
        ("text prompt without a tokenizer", {**good, "prompt": "hello"}, 400),
        ("stop strings without a tokenizer", {**good, "stop": ["x"]}, 400),
        ("n of 2", {**good, "n": 2}, 400),
        ("temperature negative", {**good, "temperature": -1}, 400),
        ("top_p zero", {**good, "top_p": 0}, 400),
        ("seed over 64 bits", {**good, "seed": 2**70}, 400),
        ("a penalty the engine lacks", {**good, "presence_penalty": 0.5}, 400),
        ("logit_bias", {**good, "logit_bias": {"5": 10}}, 400),
    ]


def test_every_bad_request_gets_its_4xx_and_the_server_stays_healthy(preset_server):
    url, ref = preset_server
    with httpx.Client(base_url=url, timeout=60) as http:
        max_context = http.get("/v1/models").json()["data"][0]["max_model_len"]
        for name, body, status in bad_requests(max_context):
            if isinstance(body, bytes):
                r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post("/v1/completions", json=body)
            assert r.status_code == status, (name, r.text)
            error = r.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", name
        chat = http.post("/v1/chat/completions", json={"model": PRESET, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
        assert http.get("/v1/nowhere").status_code == 404
        assert http.get("/v1/completions").status_code == 405
        assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/completions", json={"model": PRESET, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.json()["choices"][0]["token_ids"] == ref.generate([[1, 2, 3]], 4).tokens[0]
    models = client(url).models.list()
    assert [m.id for m in models.data] == [PRESET]


@pytest.mark.parametrize("model", ["mamba2-tiny", "rwkv7-tiny", "maskpredict-tiny"])
def test_every_family_serves_the_tokens_generate_gives(model):
    prompts = [[9, 8, 7, 300, 2], [11, 12, 13]]
    ref = load(model)
    expected = [ref.generate([p], 8).tokens[0] for p in prompts]
    with serve.running(load(model), model_name=model, max_batch=4) as url:
        api = client(url)
        whole = api.completions.create(model=model, prompt=prompts[0], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].model_extra["token_ids"] == expected[0]
        # Mask-Predict commits several tokens in one pass: a streamed event carries all of them.
        chunks = list(api.completions.create(model=model, prompt=prompts[1], max_tokens=8, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True}))
        assert [t for c in chunks for choice in c.choices for t in choice.model_extra["token_ids"]] == expected[1]
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize("server, model, used", [("preset_server", PRESET, "declab_kv_blocks_used"),
                                                 ("recurrent_server", "mamba2-tiny", "declab_slots_used")])
def test_a_cancelled_stream_frees_its_blocks_or_slot(request, server, model, used):
    url, _ = request.getfixturevalue(server)
    body = {"model": model, "prompt": [4, 5, 6], "max_tokens": 900, "stream": True, "ignore_eos": True}
    cancelled = metric(url, 'declab_requests_finished_total{finish_reason="cancelled"}', 0)
    data = []
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                data += [line] if line.startswith("data:") else []
                if len(data) == 3:
                    break
    assert len(data) == 3
    settle(url, "declab_requests_running", used)
    assert metric(url, "declab_requests_running") == 0
    assert metric(url, "declab_requests_waiting") == 0
    assert metric(url, used) == 0
    assert metric(url, 'declab_requests_finished_total{finish_reason="cancelled"}') == cancelled + 1
    assert metric(url, "declab_time_to_first_token_seconds_count") >= 1
    assert metric(url, "declab_inter_token_latency_seconds_count") >= 2


def test_text_prompt_chat_and_stop_strings_with_a_tokenizer(text_server):
    url, ref = text_server
    tokenizer = ref.tokenizer
    api = client(url)
    expected = ref.generate(["the cat sat"], 10).tokens[0]
    reply = api.completions.create(model="tiny-chat", prompt="the cat sat", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].model_extra["token_ids"] == expected
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    streamed = api.completions.create(model="tiny-chat", prompt="the cat sat", max_tokens=10, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text

    messages = [{"role": "user", "content": "hello there"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    expected = ref.generate([prompt], 6).tokens[0]
    chat = api.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].model_extra["token_ids"] == expected
    assert chat.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert chat.usage.prompt_tokens == len(prompt)
    chunks = list(api.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 6

    # Sampled (seeded) text, then the same request cut by a stop string taken from its middle.
    sampled = dict(model="tiny-chat", prompt="the cat sat", max_tokens=24, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    whole = api.completions.create(**sampled).choices[0].text
    assert len(whole) >= 8
    stop = whole[4:7]
    cut = api.completions.create(**sampled, stop=[stop])
    assert cut.choices[0].text == whole[: whole.find(stop)] and cut.choices[0].finish_reason == "stop"
    chunks = list(api.completions.create(**sampled, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole[: whole.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_text_stream_holds_back_partial_characters_and_stop_strings():
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode("héllo wörld", add_special_tokens=False)
    text = serve.TextStream(tokenizer, [])
    pieces = [text.add([i]) for i in ids] + [text.flush()]
    assert "".join(pieces) == "héllo wörld" and "\ufffd" not in "".join(pieces)
    text = serve.TextStream(tokenizer, ["lo w"])
    pieces = [text.add([i]) for i in ids] + [text.flush()]
    assert "".join(pieces) == "hél" and text.stopped
    text = serve.TextStream(None, [])
    assert text.add([3, 14]) + text.add([15]) == "3 14 15"


def test_a_full_queue_answers_503_and_the_server_recovers():
    body = {"model": PRESET, "prompt": [1, 2, 3], "max_tokens": 900, "stream": True, "ignore_eos": True}
    with serve.running(load(PRESET), model_name=PRESET, max_batch=1, max_waiting=1) as url:
        with httpx.Client(base_url=url, timeout=60) as first, httpx.Client(base_url=url, timeout=60) as second:
            with first.stream("POST", "/v1/completions", json=body) as running:
                assert running.status_code == 200
                # Keep the line iterator referenced: once collected, it closes the stream (and the server cancels it).
                lines = running.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                with second.stream("POST", "/v1/completions", json=body) as waiting:
                    assert waiting.status_code == 200
                    full = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                    assert full.status_code == 503 and full.json()["error"]["code"] == "engine_full"
        settle(url, "declab_requests_running", "declab_requests_waiting")
        assert metric(url, "declab_kv_blocks_used") == 0
        r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2, "stream": False}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


def cli(*args, **kwargs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "decoders.serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kwargs)


def test_command_line_serves_then_stops_on_sigterm():
    proc = cli("--model", PRESET, "--port", "0", "--impl", "ref", "--device", "cpu", "--log-level", "warning")
    try:
        line = proc.stdout.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert match, line + proc.stderr.read()
        url = match.group(1)
        assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
        body = {"model": PRESET, "prompt": [1, 2], "max_tokens": 40, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            # SIGTERM mid-stream: the running request is drained, not cut.
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
        assert proc.wait(timeout=60) == 0
        assert proc.stdout.read().strip() == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_command_line_cancels_what_outlives_the_drain_timeout():
    proc = cli("--model", PRESET, "--port", "0", "--impl", "ref", "--device", "cpu", "--log-level", "error", "--drain-timeout", "0.5")
    try:
        url = re.search(r"on (http://127\.0\.0\.1:\d+)", proc.stdout.readline()).group(1)
        # Seconds of decoding on a CPU, far past the drain timeout.
        body = {"model": PRESET, "prompt": [1, 2], "max_tokens": 6000, "stream": True, "ignore_eos": True}
        lines = []
        with pytest.raises(httpx.HTTPError):
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 2:
                        proc.send_signal(signal.SIGTERM)
        assert "data: [DONE]" not in lines
        assert proc.wait(timeout=60) == 0
        assert proc.stdout.read().strip() == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-preset"], "unknown preset"),
    (["--model", PRESET, "--dtype", "int3"], "unknown dtype"),
    (["--model", PRESET, "--drain-timeout", "-1"], "--drain-timeout"),
    (["--model", PRESET, "--port", "99999"], "--port must be in 0..65535, got 99999"),
    (["--model", PRESET, "--port", "-5"], "--port must be in 0..65535, got -5"),
    (["--model", "mamba2-tiny", "--page-size", "32"], "--page-size applies to the transformer family"),
])
def test_command_line_refuses_bad_options_in_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        serve.main(args)
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_command_line_refuses_a_port_in_use_before_loading(capsys):
    taken = serve.bind("127.0.0.1", 0)
    try:
        with pytest.raises(SystemExit) as exit:
            serve.main(["--model", PRESET, "--port", str(taken.getsockname()[1])])
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "cannot listen on 127.0.0.1" in err and len(err.strip().splitlines()) == 1


def test_the_serving_benchmark_runs_against_the_server(preset_server, tmp_path):
    url, _ = preset_server
    out = tmp_path / "bench.jsonl"
    run = subprocess.run([sys.executable, "-m", "decoders.serve_bench", "--models", PRESET, "--target", url, "--rate", "8",
                          "--duration", "2", "--prompt-len", "16", "--output-len", "8", "--out", str(out), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    record = json.loads(out.read_text().splitlines()[0])
    assert record["status"] == "ok" and record["failed"] == 0 and record["finished"] == record["requests"] > 0
    assert record["output_tokens"] == 8 * record["requests"]


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama-tiny", "mamba2-tiny", "rwkv7-tiny"])
def test_on_the_gpu_the_server_serves_generates_tokens(model):
    """The Triton path with CUDA graphs, captured and replayed on the engine thread, not the main one."""
    prompts = [[(5 * i + j) % 400 + 3 for j in range(4 + 3 * i)] for i in range(8)]
    ref = decoders.load(model, device="cuda", dtype="float32")
    expected = [ref.generate([p], 16).tokens[0] for p in prompts]
    # A small KV pool (the default takes 60% of the free GPU memory); the recurrent families have none.
    with serve.running(decoders.load(model, device="cuda", dtype="float32"), model_name=model, max_batch=8, num_blocks=256) as url:
        answers = [None] * len(prompts)

        def ask(i):
            reply = client(url).completions.create(model=model, prompt=prompts[i], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
            answers[i] = reply.choices[0].model_extra["token_ids"]

        concurrently(ask, len(prompts))
        assert answers == expected
        settle(url, "declab_requests_running")
        assert metric(url, "declab_requests_running") == 0


def test_the_engine_thread_selects_the_device_by_index(monkeypatch):
    """A decoder on "cuda" (no index) is served: the engine thread selects the main thread's current
    device by its index (torch.cuda.set_device refuses a device without one)."""
    selected = []
    monkeypatch.setattr(serve.torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(serve.torch.cuda, "set_device", lambda device: selected.append(serve.torch.device(device).index))

    class Idle:
        def stats(self):
            return {}

        def has_unfinished(self):
            return False

    loop = serve.EngineLoop(Idle(), serve.torch.device("cuda"), serve.Metrics())
    assert loop.device == serve.torch.device("cuda", 3)
    loop.inbox.put(("stop", None))
    loop.run()
    assert selected == [3]
