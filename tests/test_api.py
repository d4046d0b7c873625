"""`hetloco_ds.initialize` as `deepspeed.initialize`: its four return values, `training_data`
read as the CLI reads `--data`, DeepSpeed's keywords honoured or refused in one line, the CLI's
checks, and `save_pretrained` only at an outer-step boundary."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from test_cli import save_tiny_hf_with_tokenizer, write_config, write_text_folder

REPO = Path(__file__).resolve().parents[1]
H = 4


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    cfg = write_config(root / "cfg.json", {"pipeline.stages": 1, "hetloco.sparseloco.inner_steps": H})
    return {"hf": str(save_tiny_hf_with_tokenizer(root / "hf")), "data": str(write_text_folder(root / "data")),
            "config": str(cfg), "cache": str(root / "cache"), "out": str(root / "hf-out")}


def _halve_every_step(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)


def _flat(engine) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in engine.trainable_params()])


def _api_rank(rank, job):
    os.environ["HETLOCO_CACHE"] = job["cache"]
    import hetloco_ds
    from hetloco_ds import data, train

    engine, optimizer, loader, scheduler = hetloco_ds.initialize(model=job["hf"], config=job["config"],
                                                                 training_data=job["data"],
                                                                 lr_scheduler=_halve_every_step)
    # The CLI's stream of this replica, built as train.py builds it from `--data`.
    run, _, _, corpus = train.prepare_inputs(train.TrainArgs(config=job["config"], model=job["hf"], data=job["data"]),
                                             engine.world_size)
    cli = data.ReplicaBatches(corpus.train, engine.replica, engine.num_replicas, engine.micro_batch_size,
                              seed=run.hetloco.train.seed)
    out = {"same_as_cli": all(torch.equal(a, b) for p in range(6) for a, b in zip(loader.batch(p), cli.batch(p))),
           "first_batch": loader.batch(0)[0], "optimizer_is_the_engines": optimizer is engine.optimizer,
           "scheduler": type(scheduler).__name__, "data_iterator_is_loader": engine.data_iterator is loader,
           "dataloader_is_loader": engine.training_dataloader is loader}
    losses = [engine.train_batch().item() for _ in range(2)]  # no data_iter: the loader, as DeepSpeed's pipeline
    out.update(losses=losses, lr=engine.get_lr()[0], position=loader.position, micro_batches=engine.micro_batches)
    target = job["out"]
    try:
        engine.save_pretrained(target)
        out["refused"] = None
    except ValueError as err:
        out["refused"] = str(err)
    out["written_when_refused"] = os.path.exists(target)
    out["mid"] = _flat(engine)
    engine.outer_step()
    out["synced"] = engine.replicas_synced()
    engine.save_pretrained(target)
    out["after"] = _flat(engine)
    out["after_sums"] = sorted(float(p.detach().double().sum()) for p in engine.trainable_params())
    return out


def test_initialize_returns_deepspeeds_four_and_reads_training_data_as_the_cli(job):
    """2 replicas (1 stage each), H = 4: initialize returns (engine, engine.optimizer, loader,
    engine.lr_scheduler); the loader is this replica's stream exactly as `hetloco-ds train
    --data` builds it (replicas read different batches), it feeds train_batch() with no argument;
    the lr_scheduler callable is called on the engine's optimizer as DeepSpeed calls it (lr
    halves each step). After 2 inner steps save_pretrained refuses on every rank and writes
    nothing, while the replicas really differ; after outer_step() they agree and the export holds
    exactly their weights. Breaks if initialize drops a return value, ignores training_data= or
    lr_scheduler=, reads other batches than the CLI, or save_pretrained exports unsynced weights."""
    r0, r1 = run_ranks(_api_rank, 2, job)
    lr0 = json.loads(Path(job["config"]).read_text())["optimizer"]["params"]["lr"]
    for r in (r0, r1):
        assert r["same_as_cli"] and r["optimizer_is_the_engines"] and r["scheduler"] == "LambdaLR"
        assert r["data_iterator_is_loader"] and r["dataloader_is_loader"]
        assert r["lr"] == pytest.approx(lr0 * 0.25, rel=1e-12)
        assert r["position"] == 2 * r["micro_batches"]
        assert all(l == l and l > 0 for l in r["losses"])
        assert r["refused"] is not None and "not at an outer-step boundary" in r["refused"] and "\n" not in r["refused"]
        assert not r["written_when_refused"] and r["synced"]
    assert not torch.equal(r0["first_batch"], r1["first_batch"])
    assert not torch.equal(r0["mid"], r1["mid"]), "the replicas should differ between outer steps"
    assert torch.equal(r0["after"], r1["after"])
    from transformers import LlamaForCausalLM

    exported = LlamaForCausalLM.from_pretrained(job["out"]).state_dict()
    assert sorted(float(t.double().sum()) for t in exported.values()) == r0["after_sums"]


def test_every_module_imported_leaves_initialize_the_function():
    """`hetloco_ds.initialize` stays the function whatever a script imports: a submodule of that
    name (the old hetloco_ds/initialize.py) replaced it with itself once imported, so the second
    call of `hetloco_ds.initialize(...)` in a process (or the first, after `import hetloco_ds.train`)
    raised "'module' object is not callable"."""
    import importlib
    import pkgutil

    import hetloco_ds
    from hetloco_ds.api import initialize

    for info in pkgutil.iter_modules(hetloco_ds.__path__):
        importlib.import_module(f"hetloco_ds.{info.name}")
    assert hetloco_ds.initialize is initialize


def _tiny_model():
    from transformers import LlamaForCausalLM

    from conftest import tiny_llama_config

    return LlamaForCausalLM(tiny_llama_config())


@pytest.mark.parametrize("kwargs, names", [
    ({"optimizer": "adam"}, "optimizer="),
    ({"optimizer": lambda params: torch.optim.SGD(params, lr=0.1)}, "optimizer="),
    ({"lr_scheduler": torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]),
                                                        lambda s: 1.0)}, "lr_scheduler="),
    ({"mpu": object()}, "mpu="),
    ({"mesh_param": (2, 1)}, "mesh_param="),
    ({"collate_fn": list}, "collate_fn="),
    ({"model_parameters": "subset"}, "model_parameters="),
    ({"model_parameters": "groups"}, "model_parameters="),
    ({"model": torch.nn.Linear(2, 2)}, "model must be a LlamaForCausalLM"),
    ({"args": "both configs"}, "args.deepspeed_config"),
])
def test_deepspeed_keywords_it_cannot_honour_are_refused_in_one_line(kwargs, names, tmp_path):
    """Each DeepSpeed keyword initialize does not implement as DeepSpeed does is one ConfigError
    naming it, before any process group or model is built (this test has no process group).
    Breaks if one of them is silently accepted or ignored."""
    import types

    import hetloco_ds
    from hetloco_ds.config import ConfigError

    cfg = write_config(tmp_path / "cfg.json")
    model = _tiny_model()
    kwargs = dict(kwargs)
    if kwargs.get("model_parameters") == "subset":
        kwargs["model_parameters"] = list(model.parameters())[1:]
    elif kwargs.get("model_parameters") == "groups":
        kwargs["model_parameters"] = [{"params": list(model.parameters()), "lr": 1e-3}]
    if kwargs.get("args") == "both configs":
        kwargs["args"] = types.SimpleNamespace(deepspeed_config=str(cfg), local_rank=0)
    kwargs = {"model": model, "config": str(cfg), **kwargs}
    with pytest.raises(ConfigError) as err:
        hetloco_ds.initialize(**kwargs)
    assert names in str(err.value) and "\n" not in str(err.value), str(err.value)


def _config_check_rank(rank, hf, config):
    import hetloco_ds
    from hetloco_ds.config import ConfigError

    try:
        hetloco_ds.initialize(model=hf, config=config)
    except ConfigError as err:
        return str(err)
    return None


def test_initialize_runs_the_clis_checks(job):
    """examples/heterogeneous_fleet/config.json compresses replicas 4-9; on 2 ranks (2 stages, one
    replica) every rank raises the CLI's one line naming the replica, before building anything.
    Breaks if initialize skips `check_run` (then: AttributeError deep in StageAlgorithm)."""
    config = REPO / "examples" / "heterogeneous_fleet" / "config.json"
    errors = run_ranks(_config_check_rank, 2, job["hf"], str(config))
    assert errors[0] == errors[1] and errors[0] is not None
    assert "hetloco.subspace.compressed_replicas" in errors[0] and "names replica 4" in errors[0], errors[0]


def test_map_style_training_data_is_sharded_as_the_clis_blocks():
    """A torch Dataset of token blocks, and a tokenised datasets.Dataset, give every replica
    exactly the batches the CLI's ReplicaBatches gives it from the same blocks as a tensor (the
    same seeded permutation, shards and positions); a collate_fn is applied to the samples as
    DeepSpeed's loader applies it; a batch the pipeline cannot read is one DataError."""
    import datasets

    from hetloco_ds import data

    blocks = torch.randint(0, 96, (11, 8), generator=torch.Generator().manual_seed(0))
    rows = [blocks[i].clone() for i in range(len(blocks))]
    tokenised = datasets.Dataset.from_dict({"input_ids": blocks.tolist()}).with_format("torch")
    for m in range(3):
        want = data.ReplicaBatches(blocks, m, 3, 2, seed=7)
        for samples in (rows, tokenised):
            got = data.ReplicaBatches(samples, m, 3, 2, seed=7)
            for p in range(5):  # past the 3-sample shard: the next epoch's permutation
                assert all(torch.equal(a, b) for a, b in zip(got.batch(p), want.batch(p)))
    pairs = data.ReplicaBatches(rows, 1, 3, 2, seed=7, collate_fn=lambda s: (torch.stack(s), torch.stack(s) + 1))
    ids, labels = pairs.batch(0)
    assert torch.equal(ids, data.ReplicaBatches(blocks, 1, 3, 2, seed=7).batch(0)[0])
    assert torch.equal(labels, ids + 1)
    with pytest.raises(data.DataError, match="collated micro-batch is"):
        data.ReplicaBatches(rows, 0, 3, 2, collate_fn=lambda s: {"tokens": torch.stack(s)}).batch(0)


def test_a_text_dataset_is_tokenised_and_packed_as_the_cli_packs_a_dataset(tmp_path, monkeypatch):
    """training_data= a datasets.Dataset with a text column goes through the CLI's packer
    (`load_corpus` of a dataset source: documents + EOS, seq_len blocks, whole documents held out),
    not through the map-style path; a tokenizer larger than the model's vocabulary is refused in
    one line, as `hetloco-ds train` refuses it."""
    import datasets

    from hetloco_ds import api, data
    from hetloco_ds.config import ConfigError, parse_config
    from conftest import tiny_llama_config
    from test_cli import SENTENCES, tiny_tokenizer

    monkeypatch.setenv("HETLOCO_CACHE", str(tmp_path / "cache"))
    docs = [". ".join(SENTENCES[i:] + SENTENCES[:i]) * 6 for i in range(len(SENTENCES))]
    text = datasets.Dataset.from_dict({"text": docs})
    tok, llama = tiny_tokenizer(), tiny_llama_config()
    run = parse_config(json.loads(write_config(tmp_path / "cfg.json").read_text()))
    samples = api._training_samples(text, tok, None, llama, 16, "text", run, 2, None)
    want = data.load_corpus(text, tok, 16).train
    assert isinstance(samples, torch.Tensor) and torch.equal(samples, want) and samples.shape[1] == 16
    assert int(samples.eq(tok.eos_token_id).sum()) >= 1  # documents joined by EOS, as the CLI packs them
    small = tiny_llama_config(vocab=len(tok) - 1)
    with pytest.raises(ConfigError, match=f"tokenizer has {len(tok)} tokens but the model's vocab_size is"):
        api._training_samples(text, tok, None, small, 16, "text", run, 2, None)
