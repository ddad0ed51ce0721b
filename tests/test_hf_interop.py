"""Hugging Face export and import (tools/checkpoint/convert.py, megatron/hf/): for every
class, a checkpoint saved by training exports to a folder transformers loads with the same logits
(1e-4 relative, fp32, dropless) and tokens; a random transformers model imports with the same
logits, and exports back bit for bit; the imported checkpoint trains on (any ZeRO stage, EP=2);
a model larger than a memory limit converts under it; what no class computes is refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron.cli import train_tokenizer
from megatron.cli.convert_checkpoint import main
from megatron.config.flags import parse_args, with_data_parallel_size
from megatron.data.tokenizer import _bytes_to_unicode
from megatron.errors import CheckpointError, ConfigError
from megatron.hf.architectures import choose_spec
from megatron.hf.config_import import config_from_hf
from megatron.hf.from_hf import import_from_hf, vocab_divisor, weight_files
from megatron.hf.safetensors_io import parse_size
from megatron.hf.to_hf import export_to_hf
from megatron.inference.checkpoint_model import load_model
from megatron.model import GPTConfig
from megatron.model.moe import MoEConfig
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.training.loop import Trainer
from tests import inference_fixtures
from tests.dist_utils import run_distributed
from tests.test_model_flags import assert_round_trip
from tests.training_fixtures import VOCAB, tiny_config, tiny_flags, write_corpus

transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face interop tests need transformers (pip install transformers, or the package's test extra)",
)

REPO = Path(__file__).resolve().parents[1]
SINGLE = single_process_grid(torch.device("cpu"))
one_thread = inference_fixtures.one_thread  # autouse: this module's tiny models run on one thread
quiet = dict(log=lambda line: None)
TEXTS = ("the quick brown fox jumps over the lazy dog 42", "expert layer  data\tmodel\ntoken train", "café 🙂 日本")
MODERN = dict(swiglu=True, normalization="RMSNorm", disable_bias_linear=True, position_embedding_type="rope")
MOE = dict(MODERN, moe_ffn_hidden_size=16, disable_moe_token_dropping=False)

# a model of ours -> (its flags, the class it exports as, its tokenizer)
OURS = {
    "gpt2": (dict(untie_embeddings_and_output_weights=True), "gpt2", "bpe"),
    "gpt_neox": (dict(position_embedding_type="rope", rotary_percent=0.25, rotary_base=5000.0), "gpt_neox", "null"),
    "llama": (
        dict(
            MODERN,
            untie_embeddings_and_output_weights=True,
            group_query_attention=True,
            num_query_groups=2,
            kv_channels=12,
            rotary_base=5000.0,
            norm_epsilon=1e-6,
        ),
        "llama",
        "sentencepiece",
    ),
    # biases, tied, and the grouped qkv layout with one head per group
    "llama_biases": (
        dict(MODERN, disable_bias_linear=False, group_query_attention=True, num_query_groups=4),
        "llama",
        "null",
    ),
    "qwen3": (dict(MODERN, group_query_attention=True, num_query_groups=2, qk_layernorm=True), "qwen3", "null"),
    # DeepSpeed's top-2 gating: the gates renormalised, as Mixtral's
    "mixtral": (dict(MOE, num_experts=4, expert_interval=1, topk=2), "mixtral", "null"),
    # a dense first layer; Megatron-Core's pre-softmax gates, not renormalised
    "qwen3_moe": (
        dict(MOE, qk_layernorm=True, num_experts=4, expert_interval=2, topk=2, moe_router_pre_softmax=True),
        "qwen3_moe",
        "null",
    ),
    # DeepSpeed's top-1 gate (the probability as it is) and sigmoid-gated shared experts
    "qwen2_moe": (
        dict(
            MOE,
            num_experts=4,
            expert_interval=2,
            topk=1,
            moe_shared_expert_intermediate_size=24,
            moe_shared_expert_gate=True,
        ),
        "qwen2_moe",
        "null",
    ),
    # sigmoid scores, expert bias, scaled gates, 2 of 4 expert groups; shared experts; partial rope, qk norms
    "glm4_moe": (
        dict(
            MOE,
            num_experts=[1, 8],
            expert_interval=1,
            topk=4,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=2.5,
            moe_router_num_groups=4,
            moe_router_group_topk=2,
            moe_shared_expert_intermediate_size=16,
            rotary_percent=0.5,
            qk_layernorm=True,
            group_query_attention=True,
            num_query_groups=2,
            kv_channels=12,
        ),
        "glm4_moe",
        "null",
    ),
}

H = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)
# a random Hugging Face model of each class -> its config
THEIRS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32, n_inner=40, activation_function="gelu"
    ),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        **H,
        intermediate_size=48,
        use_parallel_residual=False,
        rotary_pct=0.5,
        rotary_emb_base=500.0,
        tie_word_embeddings=True,
    ),
    "llama": lambda: transformers.LlamaConfig(
        **H, intermediate_size=48, num_key_value_heads=2, head_dim=12, rope_theta=5000.0, rms_norm_eps=1e-6
    ),
    "llama_biases": lambda: transformers.LlamaConfig(
        **H, intermediate_size=48, attention_bias=True, mlp_bias=True, tie_word_embeddings=True
    ),
    "qwen3": lambda: transformers.Qwen3Config(**H, intermediate_size=48, num_key_value_heads=2, head_dim=8),
    "mixtral": lambda: transformers.MixtralConfig(
        **H, intermediate_size=16, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **H,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        num_key_value_heads=2,
        head_dim=8,
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **H,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        norm_topk_prob=False,
        qkv_bias=False,
        num_key_value_heads=2,
    ),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **H,
        intermediate_size=48,
        num_key_value_heads=2,
        head_dim=12,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
    ),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Our tokenizer flags of each kind: a SentencePiece model trained here, a small GPT-2 BPE."""
    folder = tmp_path_factory.mktemp("tokenizers")
    (folder / "corpus.txt").write_text(
        "\n".join(
            f"the quick brown fox {i} jumps over the lazy dog expert layer data model token train" for i in range(300)
        )
        + "\n"
    )
    train_tokenizer.main(
        ["--input", str(folder / "corpus.txt"), "--vocab-size", "300", "--model-prefix", str(folder / "sp")]
    )
    merges = ["t h", "Ġ th", "Ġth e", "Ã ©", "c a", "ca f", "caf Ã©"]
    pieces = list(_bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({piece: i for i, piece in enumerate(pieces)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return {
        "sentencepiece": dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(folder / "sp.model")),
        "bpe": dict(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=str(folder / "vocab.json"),
            merge_file=str(folder / "merges.txt"),
        ),
        "null": {},
    }


def texts_for(tokenizer: str) -> tuple[str, ...]:
    return TEXTS if tokenizer != "null" else ("1 2 3 59  60", "7\n8")


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def token_ids(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


def our_logits(checkpoint: Path | str, ids: torch.Tensor, iteration: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        return load_model(checkpoint, iteration=iteration).model(ids).logits_BSV


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def assert_bit_identical(first: Path, second: Path) -> None:
    a, b = hf_tensors(first), hf_tensors(second)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def same_config(first: Path, second: Path) -> None:
    """The configs as transformers reads them agree but for the tokenizer's ids and what says where
    the file came from (and multi-token-prediction layers, which our models do not have)."""

    def read(folder: Path) -> dict:
        config = transformers.AutoConfig.from_pretrained(str(folder)).to_dict()
        for key in (
            "_name_or_path",
            "transformers_version",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "num_nextn_predict_layers",
        ):
            config.pop(key, None)
        config["head_dim"] = config.get("head_dim") or config.get("hidden_size", 0) // config.get(
            "num_attention_heads", 1
        )
        return config

    assert read(first) == read(second)


def train_checkpoint(corpus: str, save: Path, flags: dict, train_iters: int = 1, **more) -> Path:
    """A checkpoint saved by training: every weight (norms, biases, the expert bias too) moved off
    its init first, so that a weight put in the wrong place shows in the logits."""
    config = tiny_config(
        corpus,
        train_iters=train_iters,
        lr_warmup_iters=0,
        save=str(save),
        init_method_std=0.2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        eval_interval=100,
        **flags,
        **more,
    )
    trainer = Trainer(config, SINGLE)
    torch.manual_seed(0)
    with torch.no_grad():
        for tensor in trainer.engine.module.state_dict(keep_vars=True).values():  # what a checkpoint holds
            if tensor.is_floating_point():
                tensor.add_(0.1 * torch.randn_like(tensor))
    trainer.train()
    return save


def random_hf_model(config, folder: Path) -> Path:
    """A transformers model with every weight random (norms and biases too), saved as save_pretrained does."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and ("e_score_correction_bias" in name or tensor.requires_grad):
                tensor.add_(0.1 * torch.randn_like(tensor))
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def exported(corpus, tokenizer_files, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Every model of OURS trained, saved and exported once: name -> (checkpoint, exported folder)."""
    out = {}
    for name, (flags, _, tokenizer) in OURS.items():
        folder = tmp_path_factory.mktemp(name)
        checkpoint = train_checkpoint(corpus, folder / "ckpt", flags, **tokenizer_files[tokenizer])
        export_to_hf(str(checkpoint), str(folder / "hf"), **quiet)
        out[name] = (checkpoint, folder / "hf")
    return out


@pytest.mark.parametrize("name", OURS)
def test_an_exported_checkpoint_loads_in_transformers_with_the_same_logits_and_tokens(name, exported):
    checkpoint, folder = exported[name]
    model_type, ids = OURS[name][1], token_ids()
    assert json.loads((folder / "config.json").read_text())["model_type"] == model_type
    theirs = hf_logits(folder, ids)
    assert theirs.std() > 0.5  # logits far from zero, so agreement means something
    assert relative_error(our_logits(checkpoint, ids), theirs) < 1e-4
    ours = load_model(checkpoint).tokenizer
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in texts_for(OURS[name][2]):
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ours.tokenize(text)
        assert tokenizer.decode(ours.tokenize(text)) == ours.detokenize(ours.tokenize(text))
    assert transformers.AutoConfig.from_pretrained(str(folder)).eos_token_id == ours.eod


@pytest.mark.parametrize("name", ["gpt2", "llama", "glm4_moe"])
def test_an_export_imports_back_bit_for_bit_with_its_tokenizer(name, exported, tmp_path):
    checkpoint, folder = exported[name]
    imported = import_from_hf(str(folder), str(tmp_path / "ckpt"), **quiet)
    ids = token_ids()
    torch.testing.assert_close(our_logits(tmp_path / "ckpt", ids), our_logits(checkpoint, ids), rtol=0, atol=0)
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.tokenizer.vocab_size == load_model(checkpoint).tokenizer.vocab_size
    assert all(
        loaded.tokenizer.tokenize(text) == load_model(checkpoint).tokenizer.tokenize(text)
        for text in texts_for(OURS[name][2])
    )
    assert "--make-vocab-size-divisible-by" in imported.flags  # the padded rows stay as they were
    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "again"), **quiet)
    assert_bit_identical(folder, tmp_path / "again")


@pytest.mark.parametrize("name", THEIRS)
def test_a_random_hf_model_imports_with_the_same_logits_and_exports_back_bit_for_bit(name, tmp_path):
    source = random_hf_model(THEIRS[name](), tmp_path / "hf")
    imported = import_from_hf(str(source), str(tmp_path / "ckpt"), **quiet)
    assert imported.folder == tmp_path / "ckpt" / "iter_0000000"
    ids = token_ids(96)
    theirs = hf_logits(source, ids)
    assert theirs.std() > 0.3 and relative_error(our_logits(tmp_path / "ckpt", ids), theirs) < 1e-4
    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), **quiet)
    assert_bit_identical(source, tmp_path / "back")
    same_config(source, tmp_path / "back")


def test_bf16_weights_round_trip_and_cast_on_request(exported, tmp_path):
    checkpoint, _ = exported["mixtral"]
    export_to_hf(str(checkpoint), str(tmp_path / "bf16"), dtype=torch.bfloat16, **quiet)
    assert {t.dtype for t in hf_tensors(tmp_path / "bf16").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    import_from_hf(str(tmp_path / "bf16"), str(tmp_path / "ckpt"), **quiet)  # kept in bf16; ours reads any dtype
    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "again"), **quiet)
    assert_bit_identical(tmp_path / "bf16", tmp_path / "again")


def test_shards_and_their_index_load_in_transformers(exported, tmp_path):
    checkpoint, _ = exported["llama"]
    export_to_hf(str(checkpoint), str(tmp_path / "hf"), max_shard_bytes=parse_size("40KB"), **quiet)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(path.name for path in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in hf_tensors(tmp_path / "hf").values())
    tensors = hf_tensors(tmp_path / "hf")
    for shard in shards:  # at most 40 KB of data, or one tensor larger than that
        held = [tensors[name].nbytes for name, file in index["weight_map"].items() if file == shard]
        assert sum(held) <= 40_000 or len(held) == 1
    ids = token_ids()
    assert relative_error(our_logits(checkpoint, ids), hf_logits(tmp_path / "hf", ids)) < 1e-4


def test_ckpt_step_picks_the_iteration(corpus, tmp_path):
    checkpoint = train_checkpoint(corpus, tmp_path / "ckpt", OURS["gpt_neox"][0], train_iters=2, save_interval=1)
    ids = token_ids()
    for step in (1, 2):
        main(["--to", "hf", "--load", str(checkpoint), "--ckpt-step", str(step), "--save", str(tmp_path / f"hf{step}")])
        assert (
            relative_error(our_logits(checkpoint, ids, iteration=step), hf_logits(tmp_path / f"hf{step}", ids)) < 1e-4
        )
    assert not torch.equal(
        hf_tensors(tmp_path / "hf1")["gpt_neox.embed_in.weight"],
        hf_tensors(tmp_path / "hf2")["gpt_neox.embed_in.weight"],
    )


def _trained_from_import(corpus: str, checkpoint: str, flags: list[str], ep_size: int, extra: list[str]) -> dict:
    """Continue pretraining from an imported checkpoint: the model's logits as loaded, and the run's loss."""
    grid = build_parallel_grid(torch.device("cpu"), ep_size=ep_size)
    argv = (
        tiny_flags(
            corpus,
            train_iters=1,
            lr_warmup_iters=0,
            load=checkpoint,
            moe_expert_parallel_size=ep_size,
            micro_batch_size=1,
            global_batch_size=2,
        )
        + flags
        + extra
    )
    trainer = Trainer(with_data_parallel_size(parse_args(argv), grid.dp_size), grid)
    start = trainer.iteration
    with torch.no_grad():
        logits = trainer.engine.module.eval()(token_ids()).logits_BSV
    return {"logits": logits, "start": torch.tensor(start), "losses": torch.tensor(trainer.train().losses)}


@pytest.mark.parametrize("extra", [[], ["--no-load-optim"], ["--reset-iteration", "--zero-stage", "3"]])
def test_an_imported_checkpoint_trains_on(corpus, tmp_path, extra):
    source = random_hf_model(THEIRS["mixtral"](), tmp_path / "hf")
    imported = import_from_hf(str(source), str(tmp_path / "ckpt"), **quiet)
    run = _trained_from_import(corpus, str(tmp_path / "ckpt"), imported.flags, 1, extra)
    assert run["start"] == 0 and len(run["losses"]) == 1 and torch.isfinite(run["losses"]).all()
    assert relative_error(run["logits"], hf_logits(source, token_ids())) < 1e-4


def test_an_imported_checkpoint_trains_under_expert_parallelism(corpus, tmp_path):
    source = random_hf_model(THEIRS["qwen2_moe"](), tmp_path / "hf")
    imported = import_from_hf(str(source), str(tmp_path / "ckpt"), ep_size=2, **quiet)
    assert "--moe-expert-parallel-size" in imported.flags
    ranks = run_distributed(_trained_from_import, 2, corpus, str(tmp_path / "ckpt"), imported.flags, 2, [])
    theirs = hf_logits(source, token_ids())
    for rank in ranks:
        assert relative_error(rank["logits"], theirs) < 1e-4 and torch.isfinite(rank["losses"]).all()


STREAMING = r"""
import resource, sys
from pathlib import Path
from megatron.cli.convert_checkpoint import main

root, margin = Path(sys.argv[1]), int(sys.argv[2])
def data_bytes():
    return 1024 * int(next(l for l in open("/proc/self/status") if l.startswith("VmData")).split()[1])

# the same code paths on a tiny model, so that the limit counts everything they load
main(["--from", "hf", "--load", str(root / "tiny_hf"), "--save", str(root / "tiny_ckpt")])
main(["--to", "hf", "--load", str(root / "tiny_ckpt"), "--save", str(root / "tiny_back")])
limit = data_bytes() + margin
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
main(["--from", "hf", "--load", str(root / "big_hf"), "--save", str(root / "big_ckpt")])
main(["--to", "hf", "--load", str(root / "big_ckpt"), "--save", str(root / "big_back"), "--max-shard-size", "100MB"])
try:  # the control: the model's weights held at once do not fit under the same limit
    held = [path.read_bytes() for path in sorted((root / "big_hf").glob("*.safetensors"))]
    print("CONTROL FITS")
except MemoryError:
    print("CONTROL OUT OF MEMORY")
"""


def write_llama_shards(folder: Path, hidden: int, layers: int, ffn: int, vocab: int) -> int:
    """A Llama folder written one shard (layer) at a time, so that this process never holds it all."""
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": vocab,
                "hidden_size": hidden,
                "intermediate_size": ffn,
                "num_hidden_layers": layers,
                "num_attention_heads": 8,
                "num_key_value_heads": 8,
                "max_position_embeddings": 64,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
                "hidden_act": "silu",
            }
        )
    )
    shards = [{"model.embed_tokens.weight": (vocab, hidden)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                **{p + f"self_attn.{x}_proj.weight": (hidden, hidden) for x in "qkvo"},
                p + "mlp.gate_proj.weight": (ffn, hidden),
                p + "mlp.up_proj.weight": (ffn, hidden),
                p + "mlp.down_proj.weight": (hidden, ffn),
            }
        )
    shards.append({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    weight_map, total, generator = {}, 0, torch.Generator().manual_seed(0)
    for number, shard in enumerate(shards):
        name = f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {key: torch.empty(shape).normal_(generator=generator) for key, shape in shard.items()}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="measures the data size in /proc (Linux)")
def test_a_model_larger_than_the_memory_limit_converts_both_ways_under_it(tmp_path):
    """RLIMIT_DATA caps the process's heap (and private mappings); the conversions stream a 320 MiB
    model under 160 MiB above what the same conversion of a tiny model needs."""
    margin = 160 << 20
    size = write_llama_shards(tmp_path / "big_hf", hidden=1024, layers=4, ffn=4096, vocab=8192)
    write_llama_shards(tmp_path / "tiny_hf", hidden=64, layers=1, ffn=64, vocab=128)
    assert size > 2 * margin
    run = subprocess.run(
        [sys.executable, "-c", STREAMING, str(tmp_path), str(margin)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "CONTROL OUT OF MEMORY" in run.stdout
    assert len(list((tmp_path / "big_ckpt" / "iter_0000000").glob("model_rank00000*.safetensors"))) > 1
    assert len(list((tmp_path / "big_back").glob("model-*.safetensors"))) > 3
    assert_bit_identical(tmp_path / "big_hf", tmp_path / "big_back")


# ---- what has no equivalent ---------------------------------------------------------------------

TINY = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=32, ffn_hidden_size=48
)
SWIGLU = dict(TINY, swiglu=True, normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope")
SWIGLU_MOE = dict(SWIGLU, num_experts=(4,), expert_interval=1, moe_ffn_hidden_size=16)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(TINY, num_experts=(4,), mlp_type="residual", moe=MoEConfig(use_residual=True)), "PR-MoE's residual MLP"),
        (dict(SWIGLU, num_layers=4, num_experts=(4, 8)), r"different expert counts \[1, 4, 1, 8\] \(a pyramid\)"),
        (dict(TINY, num_experts=(4,)), "the closest, Qwen3-MoE, has no equivalent of its LayerNorm"),  # classic MoE
        (dict(SWIGLU, normalization="LayerNorm"), "the closest, Llama, has no equivalent of its LayerNorm"),
        (dict(SWIGLU, rotary_percent=0.5), "Llama, has no equivalent of its rotary embeddings over 0.5 of each head"),
        (dict(TINY, position_embedding_type="none"), "GPT-2, has no equivalent of its lack of position embeddings"),
        (
            dict(TINY, position_embedding_type="rope", qk_layernorm=True),
            "GPT-NeoX, has no equivalent of its query/key norms",
        ),
        (dict(TINY, num_query_groups=2), "GPT-2, has no equivalent of its grouped-query attention"),
        (dict(SWIGLU_MOE, moe=MoEConfig(topk=2, router_pre_softmax=True)), "top-2 gates kept as scored"),
        (
            dict(SWIGLU_MOE, moe_shared_expert_intermediate_size=16),
            "Qwen2-MoE, has no equivalent of its ungated shared",
        ),
        (
            dict(
                SWIGLU_MOE,
                num_experts=(1, 4, 1, 4),
                num_layers=4,
                moe=MoEConfig(topk=2, router_score_function="sigmoid"),
            ),
            "dense layers after the first MoE layer",
        ),
        (
            dict(
                SWIGLU_MOE,
                num_experts=(8,),
                moe=MoEConfig(topk=4, router_score_function="sigmoid", router_num_groups=2, router_group_topk=1),
            ),
            "choosing 1 of 2 groups for 4 experts \\(groups are scored by their best 2 experts there but by their best 4",
        ),
    ],
)
def test_a_model_no_class_computes_is_refused_naming_what(options, message):
    with pytest.raises(CheckpointError, match=message):
        choose_spec(GPTConfig(**options), "CKPT")


def test_a_refused_export_writes_nothing_and_says_why(corpus, tmp_path, capsys):
    checkpoint = train_checkpoint(corpus, tmp_path / "ckpt", dict(num_experts=4, topk=2))  # the classic GELU MoE
    with pytest.raises(SystemExit) as stop:
        main(["--to", "hf", "--load", str(checkpoint), "--save", str(tmp_path / "hf")])
    assert stop.value.code == 1 and not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1
    assert (
        "no Hugging Face class computes this model exactly, and the closest, Mixtral, has no equivalent of "
        "its LayerNorm" in error
    )


@pytest.mark.parametrize(
    "config, message",
    [
        (lambda: transformers.GPT2Config(), "activation 'gelu_new' \\(ours is the exact, erf GELU\\)"),
        (lambda: transformers.GPTNeoXConfig(), "parallel residual"),
        (lambda: transformers.Qwen2MoeConfig(), "attention biases without MLP biases"),
        (lambda: transformers.LlamaConfig(attention_bias=True), "biases in the attention or the MLP alone"),
        (lambda: transformers.MixtralConfig(num_experts_per_tok=1), "top-1 routing with the gate renormalised to 1"),
        (lambda: transformers.MixtralConfig(sliding_window=4096), "sliding-window attention"),
        (
            lambda: transformers.LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            "rope scaling 'linear'",
        ),
        (
            lambda: transformers.Glm4MoeConfig(n_routed_experts=8, num_experts_per_tok=4, n_group=2, topk_group=1),
            "groups are scored by their best 2 experts there but by their best 4 here",
        ),
        (lambda: transformers.BertConfig(), "holds a 'bert' model, which this toolkit does not convert"),
    ],
)
def test_a_hf_model_ours_cannot_compute_is_refused(config, message):
    with pytest.raises(CheckpointError, match=message):
        config_from_hf(config(), "HFDIR")


@pytest.mark.parametrize("name", THEIRS)
def test_the_printed_flags_build_the_config_the_import_built(name):
    """The flags an import prints for continued training parse back to the model it wrote."""
    _, config = config_from_hf(THEIRS[name](), "HFDIR")
    assert_round_trip(config)


def test_import_refusals_before_anything_is_written(tmp_path, exported):
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="PyTorch pickles, which this converter does not read"):
        weight_files(tmp_path / "pickled")
    checkpoint, folder = exported["qwen2_moe"]
    with pytest.raises(ConfigError, match="--moe-expert-parallel-size 3 does not divide the 4 experts"):
        import_from_hf(str(folder), str(tmp_path / "ep3"), ep_size=3, **quiet)
    assert not (tmp_path / "ep3").exists()
    with pytest.raises(CheckpointError, match="already exists and is not an empty folder"):
        import_from_hf(str(folder), str(checkpoint), **quiet)
    with pytest.raises(CheckpointError, match="already exists and is not an empty folder"):
        export_to_hf(str(checkpoint), str(folder), **quiet)


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MiB", 500 << 20), ("1.5kb", 1500), ("1000", 1000)])
def test_max_shard_size_reads_hugging_faces_units(text, size):
    assert parse_size(text) == size


def test_a_bad_flag_is_one_sentence(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--from", "hf", "--load", "x", "--save", "y", "--ckpt-step", "3"])
    assert capsys.readouterr().err == "error: --ckpt-step applies to --to hf; drop it when importing with --from hf\n"
    script = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools/checkpoint/convert.py"),
            "--to",
            "hf",
            "--load",
            "x",
            "--save",
            "y",
            "--max-shard-size",
            "5 gigs",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert script.returncode == 1 and script.stdout == ""
    assert script.stderr == (
        "error: --max-shard-size '5 gigs' is not a size; write it as Hugging Face does, e.g. 5GB, 500MB or 2GiB\n"
    )


def test_the_vocabulary_divisor_keeps_the_rows_exactly():
    """GPT-2's 50257 ids in 50257 rows need --make-vocab-size-divisible-by 1 (128 would pad to 50304)."""
    assert vocab_divisor(50257, 50257) == 1 and vocab_divisor(32000, 32000) == 128
    assert vocab_divisor(151646, 151936) == 151936 and vocab_divisor(61, 128) == 128 and vocab_divisor(70, 96) == 32
