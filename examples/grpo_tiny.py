"""GRPO on a toy verifiable task, with kdaserve doing the rollouts the way Miles uses SGLang.

A trainer (this process: transformers' `KimiLinearForCausalLM`, fp32, Adam) and a
`kdaserve serve` process (started here) share one tiny random Kimi Linear checkpoint with a
16-token vocabulary: digits 0-9, SEP, END, BOS. Each step:

1. rollouts: `/generate` samples `--group` answers for each of `--batch` prompts
   (`BOS d1 d2 d3 SEP`), temperature 1, with `return_logprob` and `return_routed_experts`;
2. rewards: half for the right digit (`--task increment`: d3 + 1 mod 10; `sum`: the digit sum
   mod 10), half for END after it; advantages are rewards normalised within each group;
3. loss: the PPO-clipped GRPO objective on the answer tokens, the trainer's forward replaying
   the experts the server chose (routing replay, R3), so the trainer's logprobs equal the
   rollout's (the printed `mismatch`, ~1e-6 in fp32: a check that weights and routing agree);
4. weight sync: every parameter broadcast over torch.distributed (gloo, the trainer is rank 0)
   through `/update_weights_from_distributed`, or saved and loaded via
   `/update_weights_from_disk` with `--sync disk`; `weight_version` becomes `step-N`.

It prints reward per step, writes the curve as JSON and a PNG, and ends by timing the same
rollout request as plain serving (no logprobs, no routing) for the throughput ratio.

    python examples/grpo_tiny.py --steps 150 --out grpo.json --plot grpo.png
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
import torch.nn.functional as F

SEP, END, BOS, PAD = 10, 11, 12, 13
VOCAB, ANSWER = 16, 2
TASKS = {"increment": lambda d: (d[-1] + 1) % 10, "sum": lambda d: sum(d) % 10}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_policy(out: Path, seed: int) -> Path:
    from kdaserve.checkpoint import make_checkpoint, preset_config

    config = preset_config("tiny", vocab_size=VOCAB, bos_token_id=BOS, eos_token_ids=(END,),
                           pad_token_id=PAD)
    return make_checkpoint(out, config, seed=seed, dtype="float32", with_tokenizer=False)


def start_server(ckpt: Path, log: Path, deterministic: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", "kdaserve.cli", "serve", "--model", str(ckpt), "--host",
            "127.0.0.1", "--port", str(port), "--skip-tokenizer-init"]
    if deterministic:
        args.append("--enable-deterministic-inference")
    # one thread for the server, the rest for the trainer: they alternate, never both busy
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{log.read_text()}")


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> Any:
    r = http.post(path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text}")
    return r.json()


class RoutingReplay:
    """Makes every MoE router of the trainer's model select the experts given (one [N*T, k]
    tensor per MoE layer) instead of its own top-k; the weights are still the router's scores
    at those experts, so the router keeps its gradient (R3)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

        self.routers = [m for m in model.modules() if isinstance(m, KimiLinearTopkRouter)]
        self.ids: list[torch.Tensor] | None = None
        for j, router in enumerate(self.routers):
            router.forward = self._forward(router, router.forward, j)

    def _forward(self, router: torch.nn.Module, plain: Any, j: int) -> Any:
        def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if self.ids is None:
                return plain(hidden)
            h = hidden.view(-1, router.hidden_dim)
            logits = F.linear(h.float(), router.weight.float())
            ids = self.ids[j]
            weights = logits.sigmoid().gather(1, ids)
            if router.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            return logits, weights * router.routed_scaling_factor, ids
        return forward


def rollout(http: httpx.Client, prompts: list[list[int]], group: int,
            plain: bool = False) -> tuple[list[dict[str, Any]], float]:
    body: dict[str, Any] = {
        "input_ids": [p for p in prompts for _ in range(group)],
        "sampling_params": {"temperature": 1.0, "max_new_tokens": ANSWER, "ignore_eos": True}}
    if not plain:
        body.update(return_logprob=True, return_routed_experts=True)
    t0 = time.perf_counter()
    out = post(http, "/generate", body)
    return out, time.perf_counter() - t0


def reward(task: str, prompt: list[int], answer: list[int]) -> float:
    return 0.5 * (answer[0] == TASKS[task](prompt[1:-1])) + 0.5 * (answer[1] == END)


def token_logprobs(model: torch.nn.Module, replay: RoutingReplay, seqs: torch.Tensor,
                   routed: list[torch.Tensor] | None, prompt_len: int) -> torch.Tensor:
    """[N, ANSWER] logprobs of the answer tokens; seqs [N, P + ANSWER]. The forward runs on
    the P + ANSWER - 1 positions the server forwarded (and recorded the routing of)."""
    N, T = seqs.shape[0], seqs.shape[1] - 1
    replay.ids = None if routed is None else [r.reshape(N * T, -1) for r in routed]
    try:
        logits = model(input_ids=seqs[:, :-1]).logits.float()
    finally:
        replay.ids = None
    logp = logits[:, prompt_len - 1:].log_softmax(-1)
    return logp.gather(-1, seqs[:, prompt_len:, None]).squeeze(-1)


class WeightSync:
    """Trainer side of the refit: a gloo group with the server (rank 0 here), or disk."""

    def __init__(self, http: httpx.Client, model: torch.nn.Module, method: str,
                 workdir: Path) -> None:
        self.http, self.model, self.method, self.workdir = http, model, method, workdir
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        if method == "distributed":
            port = free_port()
            joined = self.pool.submit(post, http, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": "grpo", "backend": "gloo"})
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    world_size=2, rank=0)
            joined.result(timeout=120)

    def __call__(self, version: str) -> float:
        t0 = time.perf_counter()
        named = [(k, v.detach().contiguous()) for k, v in self.model.named_parameters()]
        if self.method == "distributed":
            sent = self.pool.submit(post, self.http, "/update_weights_from_distributed", {
                "names": [k for k, _ in named], "dtypes": [str(v.dtype) for _, v in named],
                "shapes": [list(v.shape) for _, v in named], "group_name": "grpo",
                "weight_version": version})
            for _, v in named:
                dist.broadcast(v, src=0)
            sent.result(timeout=120)
        else:
            path = self.workdir / "policy"
            self.model.save_pretrained(path)
            post(self.http, "/update_weights_from_disk", {"model_path": str(path),
                                                          "weight_version": version})
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.method == "distributed":
            post(self.http, "/destroy_weights_update_group", {"group_name": "grpo"})
            dist.destroy_process_group()
        self.pool.shutdown()


def train(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(args.seed)
    ckpt = make_policy(workdir / "init", args.seed)
    proc, url = start_server(ckpt, workdir / "server.log", args.deterministic)
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            model = KimiLinearForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
            model.train()
            replay = RoutingReplay(model)
            opt = torch.optim.Adam(model.parameters(), lr=args.lr)
            sync = WeightSync(http, model, args.sync, workdir)
            g = torch.Generator().manual_seed(args.seed)
            steps: list[dict[str, Any]] = []
            try:
                for step in range(1, args.steps + 1):
                    steps.append(train_step(args, http, model, replay, opt, sync, g, step))
                    s = steps[-1]
                    print(f"step {step:4d}  reward {s['reward']:.3f}  loss {s['loss']:+.4f}  "
                          f"mismatch {s['mismatch']:.1e}  rollout {s['rollout_tok_s']:.0f} "
                          f"tok/s  sync {s['sync_s'] * 1e3:.0f} ms  [{s['weight_version']}]",
                          flush=True)
                prompts = [[BOS, *torch.randint(0, 10, (3,), generator=g).tolist(), SEP]
                           for _ in range(args.batch)]
                plain_s = min(rollout(http, prompts, args.group, plain=True)[1]
                              for _ in range(3))
            finally:
                sync.close()
    finally:
        proc.terminate()
        proc.wait(30)
    n = args.batch * args.group * ANSWER
    rl_rate = sum(s["rollout_tok_s"] for s in steps) / len(steps)
    return {"task": args.task, "sync": args.sync, "deterministic": args.deterministic,
            "batch": args.batch, "group": args.group, "lr": args.lr, "steps": steps,
            "rollout_tok_s": rl_rate, "plain_tok_s": n / plain_s,
            "rollout_vs_plain": rl_rate * plain_s / n}


def train_step(args: argparse.Namespace, http: httpx.Client, model: torch.nn.Module,
               replay: RoutingReplay, opt: torch.optim.Optimizer, sync: WeightSync,
               g: torch.Generator, step: int) -> dict[str, Any]:
    prompts = [[BOS, *torch.randint(0, 10, (3,), generator=g).tolist(), SEP]
               for _ in range(args.batch)]
    outs, rollout_s = rollout(http, prompts, args.group)
    P, N = len(prompts[0]), len(outs)
    seqs = torch.tensor([prompts[i // args.group] + o["output_ids"] for i, o in enumerate(outs)])
    old = torch.tensor([[lp[0] for lp in o["meta_info"]["output_token_logprobs"]] for o in outs])
    # int32 [positions, MoE layers, k] per sample, base64 -> [N, positions, MoE layers, k]
    routed = torch.stack([torch.frombuffer(bytearray(base64.b64decode(
        o["meta_info"]["routed_experts"])), dtype=torch.int32).long().view(
            P + ANSWER - 1, len(replay.routers), -1) for o in outs])
    layers = [routed[:, :, j] for j in range(routed.shape[2])]
    rewards = torch.tensor([reward(args.task, prompts[i // args.group], o["output_ids"])
                            for i, o in enumerate(outs)]).view(args.batch, args.group)
    # (population std: a group of one gets advantage 0, not NaN)
    adv = ((rewards - rewards.mean(1, keepdim=True))
           / (rewards.std(1, keepdim=True, correction=0) + 1e-4)).view(N, 1)
    t0 = time.perf_counter()
    logp = token_logprobs(model, replay, seqs, layers, P)
    ratio = (logp - old).exp()
    clipped = ratio.clamp(1 - args.clip, 1 + args.clip)
    loss = -torch.min(ratio * adv, clipped * adv).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    train_s = time.perf_counter() - t0
    version = f"step-{step}"
    sync_s = sync(version)
    return {"step": step, "reward": rewards.mean().item(),
            "accuracy": (rewards >= 1).float().mean().item(), "loss": loss.item(),
            "mismatch": (logp.detach() - old).abs().max().item(),
            "rollout_s": rollout_s, "rollout_tok_s": N * ANSWER / rollout_s, "train_s": train_s,
            "sync_s": sync_s, "weight_version": outs[0]["meta_info"]["weight_version"]}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s["step"] for s in result["steps"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [s["reward"] for s in result["steps"]], label="mean reward")
    ax.plot(steps, [s["accuracy"] for s in result["steps"]], label="fully correct")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"GRPO, task '{result['task']}', rollouts by kdaserve ({result['sync']} sync)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), default="increment")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--sync", choices=["distributed", "disk"], default="distributed")
    p.add_argument("--deterministic", action="store_true",
                   help="serve with --enable-deterministic-inference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("grpo_tiny.json"))
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = train(args, Path(tmp))
    args.out.write_text(json.dumps(result, indent=1))
    first, last = result["steps"][:10], result["steps"][-10:]
    print(f"reward {sum(s['reward'] for s in first) / len(first):.3f} (first 10 steps) -> "
          f"{sum(s['reward'] for s in last) / len(last):.3f} (last 10); rollouts "
          f"{result['rollout_tok_s']:.0f} tok/s, plain serving {result['plain_tok_s']:.0f} "
          f"tok/s ({result['rollout_vs_plain']:.2f}x)")
    if args.plot is not None:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
