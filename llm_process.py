"""vLLM's LLM in a child process of its own, called over a pipe (`LLMInAProcess`): what `vllm_process` samples with,
so that the generation's host work holds that process's interpreter lock and not the trainer's."""

import atexit
import contextlib
import multiprocessing
import traceback
from types import SimpleNamespace


class LLMInAProcess:
    """vLLM's LLM in a child process, called over a pipe: `llm.generate(...)`, `llm.collective_rpc(...)` and the other
    methods run there and return their result (an error there raises here). The client's host work (sending the
    requests, turning each step's output into Python objects) holds that process's interpreter lock, where a thread of
    the trainer's would take turns with the update's kernel launches. `llm_engine` holds what VLLMRollout reads of
    vLLM's engine."""

    def __init__(self, options: dict):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA context, no torchrun threads
        self._pipe, child_end = context.Pipe()
        self._process = context.Process(target=serve, args=(child_end, options), name="vllm")
        self._process.start()
        child_end.close()
        atexit.register(self.shutdown)  # before multiprocessing's own exit handler waits for the process to end
        try:
            model_config = self._answer()
        except RuntimeError:  # vLLM did not start: its process ends
            self._process.join()
            raise
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config),
                                          engine_core=SimpleNamespace(shutdown=self.shutdown))

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args, **kwargs):
            with contextlib.suppress(BrokenPipeError):  # vLLM's process is gone: _answer says how it ended
                self._pipe.send((method, args, kwargs))
            return self._answer()

        return call

    def _answer(self):
        try:
            failed, value = self._pipe.recv()
        except (EOFError, ConnectionResetError):
            self._process.join()
            raise RuntimeError(f"vLLM's process ended (exit code {self._process.exitcode})") from None
        if failed:
            raise RuntimeError(f"vLLM's process: {value}")
        return value

    def shutdown(self) -> None:
        """vLLM's engine shut down and its process ended."""
        if self._process.is_alive():
            with contextlib.suppress(OSError, EOFError):  # a process that is ending already
                self._pipe.send(("shutdown", (), {}))
                self._pipe.recv()
            self._process.join()


def serve(pipe, options: dict) -> None:
    """vLLM's process: build the LLM, answer with what LLMInAProcess.llm_engine needs, then run each call the pipe
    brings (generate's results without their prompts, which the caller has) until shutdown or the trainer is gone."""
    from vllm import LLM

    try:
        llm = LLM(**options)
        config = llm.llm_engine.vllm_config.model_config
        pipe.send((False, SimpleNamespace(is_moe=config.is_moe, enable_sleep_mode=config.enable_sleep_mode)))
    except Exception:
        pipe.send((True, traceback.format_exc()))
        return
    while True:
        try:
            method, args, kwargs = pipe.recv()
        except EOFError:  # the trainer's process ended
            method, args, kwargs = "shutdown", (), {}
        if method == "shutdown":
            llm.llm_engine.engine_core.shutdown()
            with contextlib.suppress(OSError):
                pipe.send((False, None))
            return
        try:
            result = getattr(llm, method)(*args, **kwargs)
            if method == "generate":
                for output in result:
                    output.prompt, output.prompt_token_ids = None, None
            pipe.send((False, result))
        except Exception:
            pipe.send((True, f"{method}: {traceback.format_exc()}"))
