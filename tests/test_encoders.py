"""Encoder embedding models and cross-encoder rerankers (localserve/encoders) against
sentence-transformers itself: tiny random BERT, XLM-RoBERTa and nomic-bert checkpoints
saved by transformers, wrapped as sentence-transformers folders by sentence-transformers
(offline: the tokenizers are built here from small vocabularies), embedded and scored by
both, fp32, batched with mixed lengths and inputs past the length limit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from localserve.encoders.pipeline import read_pipeline
from localserve.encoders.pooling import matryoshka
from localserve.encoders.runner import EncoderModel
from localserve.errors import LocalserveError

st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or had "
         "by hot word but what some we can out other were all there when up use your how said an each she which "
         "do their time if will way about many then them write would like so these her long make thing see him "
         "two has look more day could go come did number sound no most people my over know water than call first "
         "who may down side been now find any new work part take get place made live where after back little only "
         "round man year came show every good me give our under name very through just form sentence great think "
         "say help low line differ turn cause much mean before move right boy old too same tell does set three "
         "want air well also play small end put home read hand port large spell add even land here must big high "
         "such follow act why ask men change went light kind off need house picture try us again animal point "
         "mother world near build self earth father").split()
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TEXTS = [
    "the boy said hello",
    "Water is wet.",
    "a",
    "the old man came back home after a long day of work in the hot sun and then he read a good book",
    "Why do people like to play?",
    "mother earth and father time were here first, near the water where the animals live",
    "zyx qwv",
    "the kind men went to build a new house, and the house was large and high with a big port",
]
PAIRS = [
    ("who came home", "the old man came back home after a long day"),
    ("water", "Water is wet."),
    ("what did the men build", "the kind men went to build a new house, and the house was large and high with "
                               "a big port near the water where the animals live and play every day of the year"),
    ("a very long question about the mother and the father and the world they live in, with many words",
     "short answer"),
]
MAX_LENGTH = 16  # tokens an input keeps: several of the texts are longer
HIDDEN, LAYERS, HEADS, FFN = 32, 2, 4, 64
POOLINGS = ["cls", "mean", "lasttoken"]
# transformers' own NomicBert (5.x) is the nomic-bert reference; nomic's remote code is not reachable offline.
FAMILIES = ("bert", "xlmr", "nomic") if hasattr(transformers, "NomicBertConfig") else ("bert", "xlmr")


def _bert_tokenizer():
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(WORDS)), *LETTERS, *".,!?",
             *(f"##{c}" for c in LETTERS)]
    return transformers.BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})


def _xlmr_tokenizer():
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(f"\u2581{w}", -3.0 - len(w) / 10) for w in sorted(set(WORDS))]
    pieces += [(c, -8.0) for c in LETTERS + LETTERS.upper() + ".,!?"] + [("\u2581", -5.0), ("<mask>", 0.0)]
    return transformers.XLMRobertaTokenizer(vocab=pieces)


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights far from the init's (layer norms too), so that every parameter shows in the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.2
            param.copy_(1 + noise if "LayerNorm.weight" in name or "layernorm.weight" in name else noise)
    return model.eval()


def _hf_folder(kind: str, path: Path, classify: bool = False) -> Path:
    """A tiny random checkpoint with its tokenizer, as transformers saves it."""
    common = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN)
    labels = dict(num_labels=1, id2label={0: "LABEL_0"}, label2id={"LABEL_0": 0}) if classify else {}
    if kind == "bert":
        tokenizer = _bert_tokenizer()
        config = transformers.BertConfig(vocab_size=len(tokenizer), max_position_embeddings=40, **common, **labels)
        cls = transformers.BertForSequenceClassification if classify else transformers.BertModel
    elif kind == "xlmr":
        tokenizer = _xlmr_tokenizer()
        config = transformers.XLMRobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=42, type_vocab_size=1,
                                               pad_token_id=1, bos_token_id=0, eos_token_id=2, **common, **labels)
        cls = transformers.XLMRobertaForSequenceClassification if classify else transformers.XLMRobertaModel
    else:
        tokenizer = _bert_tokenizer()
        config = transformers.NomicBertConfig(vocab_size=len(tokenizer), max_position_embeddings=64, **common)
        cls = transformers.NomicBertModel
    torch.manual_seed(0)
    model = cls(config, add_pooling_layer=False) if kind == "bert" and not classify else cls(config)
    _randomize(model, seed=len(kind) + classify).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _st_folder(hf_dir: Path, pooling: str, path: Path, normalize: bool = True) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(str(hf_dir), max_seq_length=MAX_LENGTH)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling)] + ([Normalize()] if normalize else [])
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    made: dict[str, Path] = {}
    for kind in FAMILIES:
        hf_dir = _hf_folder(kind, root / f"{kind}-hf")
        for pooling in POOLINGS:
            made[f"{kind}-{pooling}"] = _st_folder(hf_dir, pooling, root / f"{kind}-{pooling}")
    made["bert-mean-unnormalized"] = _st_folder(root / "bert-hf", "mean", root / "bert-unnormalized", normalize=False)
    # Hub rerankers are plain transformers folders (no modules.json); CrossEncoder saves one with modules.json.
    for kind in ("bert", "xlmr"):
        hf_dir = _hf_folder(kind, root / f"{kind}-rerank-hf", classify=True)
        config_path = hf_dir / "tokenizer_config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "model_max_length": 2 * MAX_LENGTH}))
        made[f"{kind}-rerank"] = hf_dir
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(made["bert-rerank"]), device="cpu").save(str(root / "bert-rerank-st"))
    made["bert-rerank-st"] = root / "bert-rerank-st"
    return made


@pytest.fixture(scope="module")
def sentence_transformers_models(folders: dict[str, Path]) -> dict[str, object]:
    from sentence_transformers import CrossEncoder, SentenceTransformer

    return {name: (CrossEncoder if "rerank" in name else SentenceTransformer)(str(path), device="cpu",
                                                                              local_files_only=True)
            for name, path in folders.items()}


@pytest.mark.parametrize("name", [f"{k}-{p}" for k in FAMILIES for p in POOLINGS]
                         + ["bert-mean-unnormalized"])
def test_embeddings_match_sentence_transformers(name: str, folders, sentence_transformers_models) -> None:
    reference = sentence_transformers_models[name]
    ours = EncoderModel.load(folders[name])
    assert ours.max_length == MAX_LENGTH
    encoded = ours.tokenizer.encode(TEXTS)
    expected_ids = reference.tokenize(TEXTS)  # type: ignore[attr-defined]
    for row, (item, mask) in enumerate(zip(encoded, expected_ids["attention_mask"])):
        assert item.ids == expected_ids["input_ids"][row][mask.bool()].tolist()
    assert any(item.truncated for item in encoded) and not all(item.truncated for item in encoded)
    want = reference.encode(TEXTS, convert_to_tensor=True)  # type: ignore[attr-defined]
    got = ours.embed([item.ids for item in encoded])
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # One input alone gives what it gives in the batch: nothing leaks between packed inputs.
    torch.testing.assert_close(ours.embed([encoded[3].ids]), got[3:4], atol=1e-6, rtol=0)


def test_matryoshka_truncates_then_normalizes(folders, sentence_transformers_models) -> None:
    ours = EncoderModel.load(folders["bert-mean"])
    got = matryoshka(ours.embed([item.ids for item in ours.tokenizer.encode(TEXTS)]), 8)
    want = sentence_transformers_models["bert-mean"].encode(TEXTS, convert_to_tensor=True, truncate_dim=8)
    torch.testing.assert_close(got, F.normalize(want, dim=-1), atol=1e-5, rtol=0)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)))


def test_bfloat16_stays_close(folders) -> None:
    texts = [item.ids for item in EncoderModel.load(folders["xlmr-mean"]).tokenizer.encode(TEXTS)]
    full = EncoderModel.load(folders["xlmr-mean"]).embed(texts)
    half = EncoderModel.load(folders["xlmr-mean"], dtype=torch.bfloat16).embed(texts)
    assert half.dtype == torch.float32 and F.cosine_similarity(full, half).min() > 0.99


@pytest.mark.skipif("nomic" not in FAMILIES, reason="this transformers has no NomicBert")
def test_nomic_bert_from_its_own_config_keys(folders, tmp_path: Path, sentence_transformers_models) -> None:
    """nomic-embed-text ships nomic's trust_remote_code config (GPT-2 style keys), not
    transformers' NomicBertConfig: the same weights under those keys embed the same.
    The keys are as nomic's published config.json spells them (written from memory: the
    Hub is not reachable here)."""
    folder = tmp_path / "nomic-original"
    shutil.copytree(folders["nomic-mean"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "model_type": "nomic_bert", "architectures": ["NomicBertModel"], "activation_function": "swiglu",
        "n_embd": config["hidden_size"], "n_head": config["num_attention_heads"],
        "n_layer": config["num_hidden_layers"], "n_inner": config["intermediate_size"], "n_positions": 8192,
        "vocab_size": config["vocab_size"], "type_vocab_size": 2, "layer_norm_epsilon": 1e-12,
        "rotary_emb_base": config["rope_parameters"]["rope_theta"], "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
        "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False, "causal": False,
        "use_rms_norm": False, "parallel_block": False, "max_trained_positions": 2048,
        "pad_vocab_size_multiple": 64}))
    ours = EncoderModel.load(folder)
    got = ours.embed([item.ids for item in ours.tokenizer.encode(TEXTS)])
    want = sentence_transformers_models["nomic-mean"].encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["bert-rerank", "xlmr-rerank", "bert-rerank-st"])
def test_rerank_scores_match_cross_encoder(name: str, folders, sentence_transformers_models) -> None:
    reference = sentence_transformers_models[name]
    ours = EncoderModel.load(folders[name])
    assert ours.pipeline.task == "score" and ours.pipeline.activation == "sigmoid"
    assert ours.max_length == 2 * MAX_LENGTH
    encoded = ours.tokenizer.encode_pairs(PAIRS)
    assert any(item.truncated for item in encoded)
    if name.startswith("bert"):  # the second text's segment id is 1
        assert set(encoded[0].type_ids) == {0, 1}
    want = torch.as_tensor(reference.predict(PAIRS))  # type: ignore[attr-defined]
    got = ours.score(encoded)
    assert got.shape == (len(PAIRS),)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_reranker_activation_follows_the_folder(folders, tmp_path: Path) -> None:
    folder = tmp_path / "identity"
    shutil.copytree(folders["bert-rerank"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").write_text(json.dumps(config))
    sigmoid, identity = EncoderModel.load(folders["bert-rerank"]), EncoderModel.load(folder)
    pairs = sigmoid.tokenizer.encode_pairs(PAIRS)
    torch.testing.assert_close(torch.sigmoid(identity.score(pairs)), sigmoid.score(pairs))


def _break(source: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(source, folder)
    edit(folder)
    return folder


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _drop_tensor(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    del tensors[next(name for name in tensors if name.endswith("attention.self.key.weight"))]
    save_file(tensors, folder / "model.safetensors")


def _add_tensor(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "encoder.rel_embeddings.weight": torch.zeros(4, 4)}, folder / "model.safetensors")


def _add_dense(folder: Path) -> None:
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))


@pytest.mark.parametrize("edit, message", [
    (lambda f: _edit_json(f / "config.json", hidden_size=48, num_attention_heads=4), "the config says"),
    (_drop_tensor, "qkv.weight is missing 1 of its 3 parts"),
    (_add_tensor, "is not part of a bert encoder"),
    (_add_dense, "'Dense' is not supported"),
    (lambda f: _edit_json(f / "1_Pooling" / "config.json", pooling_mode="max"), "this one: max"),
    (lambda f: _edit_json(f / "config.json", model_type="deberta-v2"), "not an encoder localserve runs"),
    (lambda f: _edit_json(f / "config.json", position_embedding_type="relative_key"), "relative_key"),
    (lambda f: (f / "modules.json").unlink(), "no modules.json"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}"), "not a valid safetensors"),
])
def test_bad_folders_fail_in_one_line(edit, message: str, folders, tmp_path: Path) -> None:
    with pytest.raises(LocalserveError, match=message) as failure:
        EncoderModel.load(_break(folders["bert-mean"], tmp_path, edit))
    assert "\n" not in str(failure.value)


def test_pipeline_reads_legacy_pooling_flags_and_max_seq_length(folders, tmp_path: Path) -> None:
    """Hub folders written by sentence-transformers before 6: pooling_mode_* flags, and the
    length limit in sentence_bert_config.json."""
    def legacy(folder: Path) -> None:
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
             "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 12, "do_lower_case": False}))

    pipeline = read_pipeline(_break(folders["bert-mean"], tmp_path, legacy))
    assert (pipeline.task, pipeline.pooling, pipeline.normalize, pipeline.max_length) == ("embed", "cls", True, 12)


def test_do_lower_case_lowercases_as_sentence_transformers_does(folders, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = _break(folders["xlmr-mean"], tmp_path, lambda f: _edit_json(f / "sentence_bert_config.json",
                                                                         do_lower_case=True))
    ours = EncoderModel.load(folder)
    encoded = ours.tokenizer.encode(TEXTS)
    assert encoded[1].ids != EncoderModel.load(folders["xlmr-mean"]).tokenizer.encode(TEXTS)[1].ids
    want = SentenceTransformer(str(folder), device="cpu", local_files_only=True).encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(ours.embed([item.ids for item in encoded]), want, atol=1e-5, rtol=0)


def test_token_inputs_are_checked(folders) -> None:
    model = EncoderModel.load(folders["bert-cls"])
    with pytest.raises(LocalserveError, match="token ids must be integers in"):
        model.embed([[2, model.config.vocab_size, 3]])
    with pytest.raises(LocalserveError, match="token ids must be integers in"):
        model.embed([[2, 1 << 70]])
    with pytest.raises(LocalserveError, match="an input takes 1 to 16"):
        model.embed([[2] * 17])
    with pytest.raises(LocalserveError, match="an input takes 1 to"):
        model.embed([[2, 3], []])
    with pytest.raises(LocalserveError, match="scores pairs"):
        EncoderModel.load(folders["bert-rerank"]).embed([[2, 3]])
