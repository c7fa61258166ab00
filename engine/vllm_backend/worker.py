"""The vLLM side of the vLLM backend: vLLM's `AsyncLLM`, driven over one connection by `VllmBackend`.

Run by the vLLM environment's python, never imported by the server's (vLLM pins older transformers and
fastapi than the server, so the two cannot share one environment):

    <vllm python> worker.py FD CONFIG_JSON

FD is this end of a socket pair (a `multiprocessing.connection.Connection`); CONFIG_JSON holds vLLM's
engine arguments. Imports only the standard library and vllm. Every message is a plain dict.

    backend -> worker                                   worker -> backend
    {"op": "generate", "id", "prompt", "params",        {"op": "ready", "info"}            once, at start
     "resumable"}                                       {"op": "out", "id", "tokens", "logprobs",
    {"op": "resume", "id", "tokens", "params"}           "finish_reason", "stop_reason", "cached"}
    {"op": "end", "id"}        a paused request ends    {"op": "gone", "id", "error",      vLLM let it go
    {"op": "abort", "id"}                                "bad_input"}
    {"op": "stats", "seq"}                              {"op": "stats", "seq", "stats"}
    {"op": "shutdown"}

A resumable request is one vLLM streaming-input session: each turn stops on EOS, a stop token or
max_tokens and then waits in vLLM with its KV kept (`finish_reason` set, the request not finished) until
the next chunk (`resume`) or the end of its input (`end`). `tokens` are the new tokens of each output
(DELTA outputs), so the backend never slices cumulative lists. Token lists handed to vLLM are always
fresh lists: vLLM 0.32 extends a session's first prompt list in place on every resume
(benchmarks/vllm_session_probe.py).
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import threading
from multiprocessing.connection import Connection

logger = logging.getLogger("infercept.vllm_worker")


class Stats:
    """The latest scheduler numbers vLLM reported (it reports after each engine step, so they lag)."""

    def __init__(self):
        self.num_steps = 0
        self.num_running = 0
        self.num_waiting = 0  # queued, and paused sessions holding KV
        self.kv_cache_usage = 0.0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0

    def logger_factory(self):
        """A `StatLoggerBase` factory for `AsyncLLM(stat_loggers=...)` that records into this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    stats.num_steps += 1
                    stats.num_running = scheduler_stats.num_running_reqs
                    stats.num_waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                    stats.kv_cache_usage = scheduler_stats.kv_cache_usage
                    stats.prefix_queried_tokens += scheduler_stats.prefix_cache_stats.queries
                    stats.prefix_hit_tokens += scheduler_stats.prefix_cache_stats.hits
                if iteration_stats is not None:
                    stats.num_prompt_tokens += iteration_stats.num_prompt_tokens
                    stats.num_generation_tokens += iteration_stats.num_generation_tokens
                    stats.num_preemptions += iteration_stats.num_preempted_reqs

            def log_engine_initialized(self):
                pass

        return Recorder

    def as_dict(self) -> dict:
        return dict(vars(self))


class Worker:
    def __init__(self, conn: Connection, config: dict):
        self.conn = conn
        self.config = config
        self.stats = Stats()
        self.inputs: dict[str, asyncio.Queue] = {}  # resumable request -> its next chunks (None: the end)
        self.tasks: dict[str, asyncio.Task] = {}  # request -> the task streaming its outputs

    async def serve(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.config),
                                             stat_loggers=[self.stats.logger_factory()])
        self.send({"op": "ready", "info": self.info()})
        commands: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self.read_commands, args=(loop, commands), daemon=True).start()
        try:
            while (msg := await commands.get())["op"] != "shutdown":
                self.handle(msg)
        finally:
            for task in self.tasks.values():
                task.cancel()
            self.llm.shutdown()
            # Collected now, while vllm's modules are alive: AsyncLLM.__del__ shuts down again and fails
            # noisily at interpreter exit.
            del self.llm
            gc.collect()

    def info(self) -> dict:
        import vllm
        from vllm.platforms import current_platform

        model, cache = self.llm.model_config, self.llm.vllm_config.cache_config
        return {"max_model_len": model.max_model_len, "vocab_size": model.get_vocab_size(),
                "dtype": str(model.dtype).removeprefix("torch."), "device": current_platform.device_type,
                "block_size": cache.block_size, "num_blocks": cache.num_gpu_blocks or 0,
                "vllm_version": vllm.__version__}

    def read_commands(self, loop: asyncio.AbstractEventLoop, commands: asyncio.Queue) -> None:
        """Blocking reads off the event loop; a closed connection (the backend went away) shuts down."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = {"op": "shutdown"}
            loop.call_soon_threadsafe(commands.put_nowait, msg)
            if msg["op"] == "shutdown":
                return

    def send(self, msg: dict) -> None:
        self.conn.send(msg)  # only the event loop thread sends

    def handle(self, msg: dict) -> None:
        from vllm import SamplingParams
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        op, rid = msg["op"], msg.get("id")
        if op == "generate":
            params = SamplingParams(**msg["params"], output_kind=RequestOutputKind.DELTA)
            prompt = TokensPrompt(prompt_token_ids=list(msg["prompt"]))
            if msg["resumable"]:
                self.inputs[rid] = asyncio.Queue()
                self.inputs[rid].put_nowait(StreamingInput(prompt, params))
                prompt = self.chunks(rid)
            self.tasks[rid] = asyncio.create_task(self.stream(rid, prompt, params))
        elif op == "resume":
            params = SamplingParams(**msg["params"], output_kind=RequestOutputKind.DELTA)
            if rid in self.inputs:
                self.inputs[rid].put_nowait(StreamingInput(TokensPrompt(prompt_token_ids=list(msg["tokens"])), params))
        elif op == "end":
            if rid in self.inputs:
                self.inputs[rid].put_nowait(None)
        elif op == "abort":
            task = self.tasks.get(rid)
            if task is not None:
                task.cancel()  # AsyncLLM.generate aborts the request when its consumer is cancelled
        elif op == "stats":
            self.send({"op": "stats", "seq": msg["seq"],
                       "stats": self.stats.as_dict() | {"num_requests": len(self.tasks)}})

    async def chunks(self, rid: str):
        """A session's input: its chunks as the backend sends them, until `end`."""
        queue = self.inputs[rid]
        while (chunk := await queue.get()) is not None:
            yield chunk

    async def stream(self, rid: str, prompt, params) -> None:
        from vllm.exceptions import VLLMClientError

        gone = {"op": "gone", "id": rid, "error": None, "bad_input": False}
        try:
            async for out in self.llm.generate(prompt, params, request_id=rid):
                self.send(self.output(rid, out))
        except asyncio.CancelledError:
            pass
        except Exception as e:  # a request vLLM refused or failed: the backend's caller gets the reason
            gone |= {"error": f"{type(e).__name__}: {e}", "bad_input": isinstance(e, (VLLMClientError, ValueError))}
        finally:
            self.tasks.pop(rid, None)
            self.inputs.pop(rid, None)
            self.send(gone)

    @staticmethod
    def output(rid: str, out) -> dict:
        c = out.outputs[0]
        logprobs = None
        if c.logprobs is not None:
            # Per token: the sampled id's logprob and [id, logprob, rank] of every entry vLLM returned
            # (the sampled token and the top `logprobs` ranks).
            logprobs = [[lps[tid].logprob, [[t, lp.logprob, lp.rank] for t, lp in lps.items()]]
                        for tid, lps in zip(c.token_ids, c.logprobs)]
        stop = c.stop_reason
        return {"op": "out", "id": rid, "tokens": list(c.token_ids), "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": stop if isinstance(stop, (int, str)) else None,
                "cached": out.num_cached_tokens or 0}


def main() -> None:
    fd, config = int(sys.argv[1]), json.loads(sys.argv[2])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(Worker(Connection(fd), config).serve())


if __name__ == "__main__":
    main()
