"""fusionpass/hf_trainer.py: after install(), the HF Trainer's training loss runs through a
compiled loss_only(model) exactly where compute_loss provably reads only the loss; everywhere else
(evaluation, return_outputs=True, a label smoother, a custom loss, an uncompiled model, hooks) it
gets the model's own outputs. CPU, tiny Llama."""
import subprocess
import sys

import pytest
import torch
from helpers import compiling

import fusionpass
from fusionpass import hf_trainer

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
IDS = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
DATA = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in IDS]


def _trainer(tmp_path, compile=True, **args):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=2,
        learning_rate=1e-3, logging_steps=1, report_to=[], torch_compile=compile, use_cpu=True, bf16=True,
        save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, **args)
    return transformers.Trainer(model=model, args=args, train_dataset=DATA, eval_dataset=DATA)


def _train_and_evaluate(tmp_path, fused):
    with compiling():
        if fused:
            fusionpass.install(cpu=True, rope_min_tokens=1, linear_cross_entropy_min_vocab=1, rms_norm_min_width=1)
        try:
            trainer = _trainer(tmp_path)
            trainer.train()
            trained = fusionpass.stats()
            evaluation = trainer.evaluate()
        finally:
            fusionpass.uninstall()
    assert bool(trained.get("linear_cross_entropy")) == fused, trained
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return trainer, losses, evaluation["eval_loss"]


def test_training_loss_without_logits_and_evaluation_with_them(tmp_path):
    plain, plain_losses, plain_eval = _train_and_evaluate(tmp_path, fused=False)
    fused, fused_losses, fused_eval = _train_and_evaluate(tmp_path, fused=True)
    assert hf_trainer._ATTRIBUTE not in plain.__dict__
    routed = fused.__dict__[hf_trainer._ATTRIBUTE][1]
    assert isinstance(routed._orig_mod, fusionpass.causal_lm.LossOnly)
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(plain_losses), rtol=2e-2, atol=0)
    # evaluation reads the logits (return_outputs=True): the model's own forward, the same loss
    assert fused_eval == pytest.approx(plain_eval, rel=2e-2)
    assert not hf_trainer.installed()


def test_routed_only_where_compute_loss_reads_the_loss_alone(tmp_path):
    trainer = _trainer(tmp_path)
    model = torch.compile(trainer.model)
    model.train()
    inputs = dict(DATA[0])
    assert hf_trainer.why_not_routed(trainer, model, inputs, return_outputs=False) is None
    assert "return_outputs" in hf_trainer.why_not_routed(trainer, model, inputs, return_outputs=True)
    assert "not a torch.compile'd" in hf_trainer.why_not_routed(trainer, trainer.model, inputs, False)
    assert "no labels" in hf_trainer.why_not_routed(trainer, model, {"input_ids": IDS[:1]}, False)
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()
    assert "compute_loss_func" in hf_trainer.why_not_routed(trainer, model, inputs, False)
    trainer.compute_loss_func = None
    handle = trainer.model.register_forward_hook(lambda *a: None)
    assert "hooks" in hf_trainer.why_not_routed(trainer, model, inputs, False)
    handle.remove()
    trainer.model.forward = lambda *a, **k: None
    assert "patched" in hf_trainer.why_not_routed(trainer, model, inputs, False)
    del trainer.model.forward
    model.eval()
    assert "eval" in hf_trainer.why_not_routed(trainer, model, inputs, False)
    smoothing = _trainer(tmp_path, label_smoothing_factor=0.1)
    assert "label smoother" in hf_trainer.why_not_routed(smoothing, torch.compile(smoothing.model), inputs, False)


def test_install_before_transformers_is_imported():
    """install() may come first in a script: Trainer is patched when transformers.trainer loads,
    and uninstall() undoes it."""
    code = (
        "import sys, fusionpass\n"
        "fusionpass.install()\n"
        "assert 'transformers.trainer' not in sys.modules\n"
        "from transformers import Trainer\n"
        "assert hasattr(Trainer.compute_loss, 'fusionpass_original')\n"
        "fusionpass.uninstall()\n"
        "assert not hasattr(Trainer.compute_loss, 'fusionpass_original')\n"
        "fusionpass.install(trainer_loss_only=False)\n"
        "assert not hasattr(Trainer.compute_loss, 'fusionpass_original')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
