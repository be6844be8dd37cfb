"""The prefix cache on the server path, where requests arrive one by one: a request that
forks from an earlier one's prompt after that one finished resumes from the state snapshot
the earlier one left on its way (every `prefill_snapshot_stride` tokens), so a shared
prefix is computed once, as in one process."""

from __future__ import annotations

import random

import httpx

from tests.server.conftest import ServerProc, metrics


def test_fork_after_the_first_request_finished(server: ServerProc, http: httpx.Client) -> None:
    rng = random.Random(5)
    prefix = [rng.randrange(256, 3800) for _ in range(300)]
    prompts = [prefix + [rng.randrange(256, 3800) for _ in range(20)] for _ in range(6)]
    assert http.post("/flush_cache").status_code == 200
    before = metrics(http)["kdaserve_prompt_tokens"]
    cached = []
    for ids in prompts:  # one at a time: no two are ever in the scheduler together
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text
        cached.append(r.json()["meta_info"]["cached_tokens"])
    computed = metrics(http)["kdaserve_prompt_tokens"] - before
    # the first computes all 320; each later one resumes at 256, the last 64-token grid point
    # inside the shared 300 (without the stride snapshots the second recomputed all 320)
    assert cached == [0] + [256] * 5
    assert computed == 320 + 5 * 64
