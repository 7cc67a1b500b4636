"""A sampler that needs no vLLM: the trainer's own sharded model samples (`--rollout.name native`). No weight sync and
exact log-probs; it recomputes the whole prefix each token (no KV cache), so it is for tests, the CPU demo and
checking a sampler of your own against."""

import torch
import torch.distributed as dist

from config import Config
from engine import pack
from rollout import Rollout


class NativeRollout:
    """Samples with the trainer's own sharded model; every rank runs as many forwards (FSDP's lockstep)."""

    environment: dict[str, str] = {}
    uses_rollout_tp = False
    generates_beside_the_trainer = False  # it samples with the weights the trainer updates

    def __init__(self, cfg: Config, engine, eos_token_ids: list[int]):
        self.cfg, self.engine, self.eos = cfg, engine, set(eos_token_ids)

    def generate(self, prompt_ids: list[list[int]], n: int, greedy: bool = False, seed: int = 0,
                 logprob_samples: int | None = None) -> Rollout:
        """n samples per prompt (or one greedy response each); `seed` makes the draw reproducible; the
        log-probs come free here, so every response has them whatever `logprob_samples` asks."""
        r = self.cfg.rollout
        n = 1 if greedy else n
        prompts = [list(p) for p in prompt_ids for _ in range(n)]
        generator = torch.Generator().manual_seed(seed)
        responses, logprobs, done = [[] for _ in prompts], [[] for _ in prompts], [False] * len(prompts)
        for position in range(self.cfg.data.max_response_length):
            if not self._any_rank_active(done):
                break
            if position % 64 == 63 and dist.get_rank() == 0:  # a progress line: this sampler is slow
                print(f"native rollout: {position + 1}/{self.cfg.data.max_response_length} tokens, "
                      f"{done.count(False)}/{len(done)} responses open", flush=True)
            live = [i for i, d in enumerate(done) if not d] or [0]  # keep forwarding in lockstep
            logits = self._next_token_logits([prompts[i] + responses[i] for i in live])
            tokens, token_logprobs = sample(logits, 1.0 if greedy else r.temperature, r.top_k, r.top_p,
                                            greedy, generator)
            for i, token, logprob in zip(live, tokens.tolist(), token_logprobs.tolist()):
                if done[i]:
                    continue
                responses[i].append(token)
                logprobs[i].append(logprob)
                done[i] = token in self.eos
        finish = ["stop" if resp and resp[-1] in self.eos else "length" for resp in responses]
        return Rollout(prompts, responses, logprobs, finish)

    def _any_rank_active(self, done: list[bool]) -> bool:
        active = torch.tensor([0.0 if all(done) else 1.0])
        dist.all_reduce(active)  # all ranks (FSDP and TP groups) step together
        return active.item() > 0

    def _next_token_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        tokens, positions = pack(sequences)
        last = torch.tensor([len(s) for s in sequences]).cumsum(0) - 1
        with self.engine.eval_mode():
            logits = self.engine.full_logits(tokens, positions)
        return logits[last].float()

    def sync_weights(self) -> float:
        return 0.0  # samples with the trained weights themselves

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, greedy: bool,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens, log-probs of the processed distribution)."""
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative - sorted_logits.softmax(-1) > top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))
    logprobs = torch.log_softmax(logits, dim=-1)
    if greedy:
        tokens = logits.argmax(-1)
    else:
        # on the host with a CPU generator: the same draw on every rank and device, reproducible from `seed`
        tokens = torch.multinomial(logprobs.exp().cpu(), 1, generator=generator)[:, 0].to(logits.device)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


SAMPLER = NativeRollout  # what rollout.name=native builds (plugins.SAMPLERS)
