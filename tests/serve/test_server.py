"""The real server: ``python -m splice.cli serve`` on the default SmolLM2 model (fp32, kernel-injected) as a
subprocess on a free port, talked to with the official ``openai`` client and with raw HTTP."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.tp.launch import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
MAX_LEN = 256


class Server:
    """``splice serve`` (or ``torchrun ... splice serve``) in its own process group, its log in ``log``."""

    def __init__(self, tmp: Path, *options: str, launcher: tuple[str, ...] = (), env: dict | None = None,
                 wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        command = [*(launcher or (sys.executable,)), "-m", "splice.cli", "serve", "--dtype", "fp32",
                   "--max-out-tokens", str(MAX_LEN), "--served-model-name", "smol", "--port", str(self.port), *options]
        env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": "1", **(env or {})}
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited {self.process.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"the server did not start in {timeout} s:\n{self.log.read_text()}")

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self) -> None:
        """SIGKILL to the server and every process under it: torchrun's workers run in sessions of their own, so
        killing its process group alone would leave them serving."""
        if self.process.poll() is None:
            for pid in [*descendants(self.process.pid), self.process.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.process.wait(30)


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, their children, ...), read from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("serve"), "--max-batch", "8")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """The unmodified Hugging Face model in this process (fp32, the weights the server loads): what a request gives
    alone through its generate. One torch thread while the server runs beside it: two processes each spinning two
    threads on two busy cores slow both many times over."""
    import splice

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = splice.load("smollm2-135m-instruct")
    assert model.dtype == torch.float32
    yield model, tokenizer
    torch.set_num_threads(threads)


def alone(reference, ids: list[int], new: int) -> list[int]:
    """HF's greedy tokens, stopping at the generation config's end-of-sequence ids as the server does; the gap
    between the two best logits stays above rounding, so no token is a near-tie the batch could flip."""
    model, _ = reference
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert min(float(top[0, 0] - top[0, 1]) for top in (logits.topk(2).values for logits in out.logits)) > 1e-4
    return out.sequences[0, len(ids):].tolist()


def ids_of(logprobs) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in logprobs.tokens]


def test_completion_is_the_engines_greedy_continuation(client, reference):
    _, tokenizer = reference
    ids = tokenizer("The capital of France is").input_ids
    result = client.completions.create(model="smol", prompt=ids, max_tokens=6, temperature=0, logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True})
    choice = result.choices[0]
    assert ids_of(choice.logprobs) == alone(reference, ids, 6)
    assert choice.text.startswith(" Paris") and choice.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(ids), 6)
    tops = choice.logprobs.top_logprobs
    assert all(abs(max(top.values()) - value) < 1e-4 for top, value in zip(tops, choice.logprobs.token_logprobs))


def test_chat_and_its_stream_with_usage(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="smol", messages=messages, max_tokens=8, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length") and "Paris" in whole.choices[0].message.content
    chunks = list(client.chat.completions.create(model="smol", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_exactly(client, stream):
    prompt = "The capital of France is"
    full = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    stop = full[8:11]  # inside the continuation: the text must end right before it
    assert stop and stop in full
    kwargs = dict(model="smol", prompt=prompt, max_tokens=8, temperature=0, stop=[stop, "unseen"])
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert text == full[:full.index(stop)] and finish == "stop"


def test_seed_reproduces_and_n_gives_indexed_choices(client):
    kwargs = dict(model="smol", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1234)
    single = client.completions.create(**kwargs)
    first, first_usage = single.choices[0].text, single.usage
    assert client.completions.create(**kwargs).choices[0].text == first
    both = client.completions.create(n=2, **kwargs)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text == first
    assert both.usage.prompt_tokens == first_usage.prompt_tokens  # the prompt counts once


def test_chat_logprobs(client):
    result = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=0, logprobs=True, top_logprobs=3)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens and all(len(item.top_logprobs) == 3 for item in content)
    assert bytes(b for item in content for b in item.bytes).decode("utf-8").startswith(
        result.choices[0].message.content[:1])


def test_16_concurrent_streams_match_each_request_alone(client, reference):
    _, tokenizer = reference
    words = "the quick brown fox jumps over the lazy dog while a small bird sings in the old oak tree".split()
    prompts = [tokenizer(" ".join(words[:2 + 3 * k % len(words)]) + f" {k}").input_ids for k in range(16)]

    def run(ids):
        stream = client.completions.create(model="smol", prompt=ids, max_tokens=6, temperature=0, stream=True,
                                           logprobs=0, extra_body={"return_tokens_as_token_ids": True})
        tokens, finish = [], None
        for chunk in stream:
            if chunk.choices[0].logprobs is not None:
                tokens += ids_of(chunk.choices[0].logprobs)
            finish = chunk.choices[0].finish_reason or finish
        return tokens, finish

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, prompts))
    assert len({len(p) for p in prompts}) > 8
    for ids, (tokens, finish) in zip(prompts, results):
        assert finish in ("stop", "length") and tokens == alone(reference, ids, 6)


@pytest.mark.parametrize("body, status, named", [
    (b"{broken", 400, "not valid JSON"),
    ({"model": "gpt-4o", "prompt": "x"}, 404, "gpt-4o"),
    ({"model": "smol", "prompt": ""}, 400, "prompt=''"),
    ({"model": "smol", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens='ten'"),
    ({"model": "smol", "prompt": "x", "max_tokens": MAX_LEN}, 400, f"max_tokens <= {MAX_LEN - 1}"),
    ({"model": "smol", "prompt": "x", "temperature": -1}, 400, "temperature=-1"),
    ({"model": "smol", "prompt": [0, 10**6]}, 400, "1000000"),
])
def test_raw_http_errors_name_the_value(server, body, status, named):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{server.url}/v1/completions", timeout=30, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert named in error["message"] and error["type"] == "invalid_request_error"


def test_the_log_says_where_the_server_listens(server):
    """The socket is bound before the model loads and handed to uvicorn, which logs where it listens only for the
    sockets it binds itself: splice logs the same line for this one."""
    assert f"Uvicorn running on {server.url} (Press CTRL+C to quit)" in server.log.read_text()


def test_unknown_route_and_metrics(server):
    missing = httpx.get(f"{server.url}/v1/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("splice_requests_total", "splice_prompt_tokens_total", "splice_generation_tokens_total",
                 "splice_queue_depth", "splice_running_batch_size", "splice_time_to_first_token_seconds_bucket",
                 "splice_inter_token_latency_seconds_bucket"):
        assert name in metrics
    assert 'splice_requests_total{endpoint="/v1/completions",status="400"}' in metrics


# --- one row, one queue place: the queue limit, a disconnect, SIGTERM ----------------------------------------------
@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("serve-small"), "--max-batch", "1", "--max-queue", "1")
    yield server
    server.stop()


def sse_lines(response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


LONG = {"model": "smol", "prompt": "Count: 1, 2, 3,", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
        "stream": True}


def wait_for(server: Server, predicate, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.stats()
        if predicate(stats):
            return stats
        time.sleep(0.1)
    raise AssertionError(f"timed out; last stats {stats}")


def test_full_queue_429_then_a_disconnect_frees_the_row(small_server):
    url = f"{small_server.url}/v1/completions"
    with httpx.Client(timeout=120) as streaming:
        with streaming.stream("POST", url, json=LONG) as running:
            assert running.status_code == 200
            lines = sse_lines(running)  # kept: a dropped line iterator would close the stream
            next(lines)  # the long request holds the only row
            queued: dict = {}
            waiter = threading.Thread(target=lambda: queued.update(
                httpx.post(url, json={"model": "smol", "prompt": "Hi", "max_tokens": 2}, timeout=120).json()))
            waiter.start()
            wait_for(small_server, lambda s: s["queued"] == 1 and s["running"] == 1)
            busy = httpx.post(url, json={"model": "smol", "prompt": "Hi", "max_tokens": 2}, timeout=30)
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "queue_full"
        # leaving the stream closed the connection: the long request is cancelled, the queued one gets the row
        waiter.join(120)
    assert queued["choices"][0]["finish_reason"] in ("stop", "length")
    wait_for(small_server, lambda s: s["queued"] == 0 and s["running"] == 0)
    metrics = httpx.get(f"{small_server.url}/metrics", timeout=10).text
    assert "splice_running_batch_size 0.0" in metrics and 'status="429"} 1.0' in metrics


def test_a_client_that_leaves_a_plain_request_frees_its_row(small_server):
    body = {**LONG, "stream": False, "max_tokens": MAX_LEN - 16}  # many seconds of decoding if nobody cancelled it
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{small_server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
    wait_for(small_server, lambda s: s["running"] == 0 and s["queued"] == 0, timeout=8)
    served = httpx.post(f"{small_server.url}/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 2},
                        timeout=60)
    assert served.status_code == 200


def test_sigterm_finishes_the_running_request_then_exits_0(small_server):
    body = {**LONG, "max_tokens": 24}
    with httpx.stream("POST", f"{small_server.url}/v1/completions", json=body, timeout=120) as response:
        lines = sse_lines(response)
        first = next(lines)
        small_server.process.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(line) for line in [first, *rest[:-1]]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert small_server.process.wait(60) == 0


# --- tensor parallelism --------------------------------------------------------------------------------------------
def test_tp2_server_on_gloo(tmp_path, client):
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()))
    server = Server(tmp_path, "--tp", "2", launcher=launcher)
    try:
        body = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        single = client.completions.create(**body).choices[0].text
        assert response.json()["choices"][0]["text"] == single
    finally:
        server.stop()


def test_a_rank_that_dies_ends_the_tp_server_non_zero(tmp_path):
    """The ranks started by hand (torchrun would end the server itself when a worker dies): rank 0's scheduler
    fails on its next collective, and the server logs it and exits 1."""
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
             "LOCAL_WORLD_SIZE": "2", "SPLICE_DIST_TIMEOUT_S": "20"}
    follower = Server(tmp_path, "--tp", "2", env={**world, "RANK": "1", "LOCAL_RANK": "1"}, wait=False)
    server = Server(tmp_path, "--tp", "2", env={**world, "RANK": "0", "LOCAL_RANK": "0"})
    try:
        follower.stop()  # SIGKILL: the rank is gone without a word
        started = time.monotonic()
        body = {"model": "smol", "prompt": "Hi", "max_tokens": 4, "temperature": 0}
        try:
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code >= 500
        except httpx.HTTPError:
            pass  # the server may already be going down
        assert server.process.wait(60) == 1
        assert time.monotonic() - started < 60
        assert "scheduler failed" in server.log.read_text()
    finally:
        server.stop()
        follower.stop()
