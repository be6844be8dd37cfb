"""Each `kdaserve bench` sub-command runs end to end on a tiny checkpoint and writes its JSON
(numbers are not asserted: speed is measured in benchmarks, not tests)."""

from __future__ import annotations

import json
from pathlib import Path

from kdaserve.cli import main as cli_main
from tests.ports import free_port


def test_bench_throughput_smoke(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    cli_main(["bench", "throughput", "--model", str(tiny_ckpt), "--batch-sizes", "1,3",
              "--input-len", "8", "--output-len", "4", "--backends",
              "kdaserve,hf,deterministic,nocache", "--rounds", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["round"], r["backend"], r["batch"]) for r in rows) == sorted(
        (k, b, n) for k in (0, 1) for b in ("kdaserve", "hf", "deterministic", "nocache")
        for n in (1, 3))
    assert all(r["vs_plain"] > 0 for r in rows if r["backend"] in ("deterministic", "nocache"))
    assert all(r["output_tokens"] == r["batch"] * 4 for r in rows)


def test_bench_prefix_cache_smoke(tiny_ckpt: Path, tmp_path: Path, gsm8k_file: Path) -> None:
    out = tmp_path / "p.json"
    cli_main(["bench", "prefix-cache", "--model", str(tiny_ckpt), "--data", str(gsm8k_file),
              "--num-questions", "3",
              "--num-shots", "2", "--parallel", "1", "--max-tokens", "2", "--repeats", "1",
              "--turns", "3", "--message-tokens", "8", "--turn-tokens", "4", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["gsm8k_cache_on"]["output_tokens"] == r["gsm8k_cache_off"]["output_tokens"] == 6
    assert r["gsm8k_cache_on"]["prompt_tokens_computed"] < \
        r["gsm8k_cache_off"]["prompt_tokens_computed"]
    assert len(r["chat_ttft_cache_on_s"]) == 3


def test_bench_gsm8k_smoke(tiny_ckpt: Path, tmp_path: Path, gsm8k_file: Path) -> None:
    out = tmp_path / "g.json"
    cli_main(["bench", "gsm8k", "--model", str(tiny_ckpt), "--data", str(gsm8k_file),
              "--backend", "kdaserve,hf",
              "--num-questions", "3", "--num-shots", "2", "--parallel", "1,2", "--max-tokens",
              "3", "--ignore-eos", "--compare", "--out", str(out)])
    r = json.loads(out.read_text())
    assert len(r["rows"]) == 4 and out.with_suffix(".png").is_file()
    assert all(row["output_tokens"] == 9 for row in r["rows"])
    assert r["machine"]["gemm_gflops"] > 0 and "gemm_peak_fraction" in r["rows"][0]


def test_gsm8k_prompt_format_and_scoring() -> None:
    from kdaserve.bench.gsm8k import INVALID, answer_value, build_prompts

    rows = [{"question": f"q{i}?", "answer": f"work\n#### {i},000"} for i in range(4)]
    prompts, labels = build_prompts(rows, shots=2, n=3)
    shot = "Question: q0?\nAnswer: work\n#### 0,000\n\nQuestion: q1?\nAnswer: work\n#### 1,000\n\n"
    assert prompts[2] == shot + "Question: q2?\nAnswer:"
    assert labels == [0, 1000, 2000]
    assert answer_value("so 3 + 4 = 7 apples") == 7 and answer_value("none") == INVALID


def test_bench_spec_smoke(tiny_ckpt: Path, tmp_path: Path, gsm8k_file: Path) -> None:
    from kdaserve.checkpoint import make_checkpoint, preset_config
    from kdaserve.config import DENSE, KDA, MLA, MOE
    from kdaserve.speculative.block import make_block_drafter
    from kdaserve.speculative.dspark import make_dspark_drafter

    tiny = preset_config("tiny")
    draft = make_checkpoint(tmp_path / "draft", preset_config(
        "tiny", num_hidden_layers=2, layer_types=(KDA, MLA), mlp_types=(DENSE, MOE)), seed=1,
        with_tokenizer=False)
    block = make_block_drafter(tmp_path / "block", tiny, seed=1)
    dspark = make_dspark_drafter(tmp_path / "dspark", tiny, taps=[1, 3], seed=1)
    from kdaserve.speculative.token_map import save_token_map

    hot = save_token_map(list(range(0, tiny.vocab_size, 3)), tmp_path / "hot.json")
    out = tmp_path / "s.json"
    cli_main(["bench", "spec", "--model", str(tiny_ckpt), "--data", str(gsm8k_file),
              "--num-shots", "1", "--num-prompts", "2", "--max-tokens", "6", "--k", "2",
              "--batch-sizes", "1,2", "--repeats", "1", "--drafters",
              "ngram,self,self-half,draft-self,draft,block,dspark", "--draft-model",
              str(draft), "--block-drafter", str(block), "--dspark-drafter", str(dspark),
              "--out", str(out), "--plot", str(tmp_path / "s.png"), "--tune-ngram",
              "--token-map", str(hot)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["token_map"] == str(hot)
    assert all(len(r["paired_decode_speedups"]) == 1 for r in rows if r["drafter"] != "none")
    assert {(r["max_n"], r["min_n"]) for r in result["ngram_offline"]} >= {(4, 1), (2, 2)}
    names = ["none", "ngram", "self", "self-half", "draft-self", "draft", "block", "dspark"]
    assert [(r["batch"], r["drafter"]) for r in rows] == [(b, n) for b in (1, 2)
                                                         for n in names]
    for b in (0, 8):
        # the self-drafts propose the target's own tokens: everything is accepted; self-half
        # corrupts the second of two drafts, so exactly one is accepted per verify
        assert rows[b + 2]["acceptance_length"] > 2 and rows[b + 4]["acceptance_length"] > 2
        assert rows[b + 3]["acceptance_length"] == 2
        assert rows[b + 2]["kept_by_position"] == [1.0, 1.0]
        assert rows[b + 3]["kept_by_position"] == [1.0, 0.0]
    assert (tmp_path / "s.png").stat().st_size > 0


def test_bench_spec_k3_formats_force_drafts(k3_ckpt: Path, tmp_path: Path,
                                           gsm8k_file: Path) -> None:
    """K3's published formats, written with random weights for the target, every draft
    verified: each row has the cost split and the acceptance length a drafted step needs."""
    out = tmp_path / "s.json"
    cli_main(["bench", "spec", "--model", str(k3_ckpt), "--data", str(gsm8k_file),
              "--num-shots", "1", "--num-prompts", "1", "--max-tokens", "8", "--k", "3",
              "--batch-sizes", "1", "--repeats", "1", "--drafters",
              "k3-dspark-mla,k3-dspark-gqa,dflash", "--k3-drafters", str(tmp_path / "d"),
              "--force-drafts", "--min-acceptance-rate", "0", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"][1:]
    assert [r["drafter"] for r in rows] == ["k3-dspark-mla", "k3-dspark-gqa", "dflash"]
    for r in rows:
        c = r["ms_per_step"]
        assert c["drafted_share"] > 0.5 and c["verify"] > 0 and c["draft_per_verify"] > 0
        assert r["break_even_acceptance_length"] > 1
    assert (tmp_path / "d" / "dflash" / "config.json").is_file()


def test_bench_kernels_smoke(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    cli_main(["bench", "kernels", "--model", str(tiny_ckpt), "--batch-sizes", "1,2",
              "--prompt-len", "20", "--overhead-model", str(tiny_ckpt), "--out", str(out)])
    r = json.loads(out.read_text())
    ops = {(row["op"], row["backend"]) for row in r["rows"]}
    assert {("kda_decode", "ref"), ("kda_decode", "native"), ("linear", "native")} <= ops
    assert all(row["vs_ref"] for row in r["rows"])
    assert [o["batch"] for o in r["host_overhead"]] == [1, 16, 64]
    assert all(0 < o["forward_ms"] < o["step_ms"] for o in r["host_overhead"])
    assert all(o["per_op_step_ms"] > 0 for o in r["host_overhead"])  # tiny has the one call


def test_bench_grammar_smoke(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "gr.json"
    cli_main(["bench", "grammar", "--model", str(tiny_ckpt), "--batch", "1,2",
              "--max-tokens", "24", "--out", str(out)])
    r = json.loads(out.read_text())
    assert [row["batch"] for row in r["throughput"]] == [1, 2]
    assert r["engines"]["llguidance"]["mask_ms"] > 0


def test_bench_scoring_smoke(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "sc.json"
    cli_main(["bench", "scoring", "--model", str(tiny_ckpt), "--lengths", "16,40",
              "--batch", "2", "--repeats", "1", "--out", str(out)])
    r = json.loads(out.read_text())
    assert [row["length"] for row in r["rows"]] == [16, 40]
    assert all(row["plain_s"] > 0 and row["scored_s"] > 0 for row in r["rows"])


def test_bench_soak_smoke(tiny_ckpt: Path, tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "soak.json"
    cli_main(["bench", "soak", "--model", str(tiny_ckpt), "--requests", "40",
              "--concurrency", "8", "--distinct", "6", "--max-tokens", "8",
              "--port", str(port), "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["failures"] == 0 and r["mismatches"] == 0 and r["pools_back"]
    assert r["completed"] > 0 and r["completed"] + r["disconnected"] <= 40


def test_bench_weight_sync_smoke(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "ws.json"
    cli_main(["bench", "weight-sync", "--model", str(tiny_ckpt), "--repeats", "1",
              "--out", str(out)])
    r = json.loads(out.read_text())
    assert [row["method"] for row in r["rows"]] == ["disk", "tensor", "distributed"]
    assert all(row["seconds"] > 0 for row in r["rows"])


def test_bench_pd_smoke(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    cli_main(["bench", "pd", "--model", str(tiny_ckpt), "--num-prompts", "4",
              "--input-len", "96", "--output-len", "4", "--request-rate", "20",
              "--max-num-batched-tokens", "32", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["unified"]["completed"] == r["pd"]["completed"] == 4
    t = r["pd"]["transfer"]
    assert t["state_bytes_per_request"] > 0 and t["writes_per_request"] > 1
    assert r["pd"]["decode_prompt_tokens"] == 0


def test_bench_accuracy_smoke(small_ckpt: Path, tmp_path: Path, gsm8k_file: Path) -> None:
    out = tmp_path / "acc.json"
    cli_main(["bench", "accuracy", "--model", str(small_ckpt), "--data", str(gsm8k_file),
              "--variants", "fp32,bf16", "--positions", "40", "--window", "16",
              "--greedy-prompts", "2", "--greedy-tokens", "4", "--out", str(out)])
    fp32, bf16 = json.loads(out.read_text())["rows"]
    assert fp32["positions"] == bf16["positions"] == 40
    # fp32 against itself reads exactly zero; the small preset is stored fp32, so rounding
    # its weights to bf16 moves the logits
    assert fp32["max_abs_dlogit"] == fp32["mean_kl"] == 0
    assert fp32["top1_agreement"] == fp32["greedy_identical"] == 1
    assert bf16["max_abs_dlogit"] > 0 and bf16["mean_kl"] > 0
