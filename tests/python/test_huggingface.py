"""Hugging Face model directories and ckptfs: a tiny randomly initialised
Llama-style model written by save_pretrained (sharded safetensors with their
index, config, generation config, tokenizer files) imports as one
checkpoint, and AutoModelForCausalLM.from_pretrained loads the mounted
checkpoint directory as it is, with identical logits. Nothing is downloaded."""
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
from helpers import CkptTestCase  # noqa: E402

try:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    HF_REASON = None
except ImportError as e:  # the test environment installs transformers
    HF_REASON = f"transformers is not importable: {e}"
HAVE_FUSE = os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


def tiny_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_tokenizer():
    vocab = {f"w{i}": i for i in range(92)} | {"<unk>": 92, "<s>": 93, "</s>": 94, "<pad>": 95}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")


def unmount(path):
    """fusermount3 -u, retried while a reader lets go of its files."""
    deadline = time.monotonic() + 10
    while subprocess.run(["fusermount3", "-u", path], stderr=subprocess.DEVNULL).returncode != 0:
        if time.monotonic() > deadline:
            subprocess.run(["fusermount3", "-u", "-z", path])
            raise AssertionError(f"{path} stayed busy for 10 s")
        time.sleep(0.1)


def assert_loads_like(test, directory, model, ids):
    """from_pretrained(directory) gives the logits `model` gives for `ids`; returns the loaded model."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        test.assertTrue(torch.equal(loaded(ids).logits, model(ids).logits))
    return loaded


@contextlib.contextmanager
def mounted(test):
    """The test's repository mounted on a fresh directory; unmounted after
    the loaded models (which may map its files) are collected."""
    mnt = tempfile.mkdtemp(prefix="ckptfs-hf-mnt-")
    test.run_ckpt("mount", mnt)
    try:
        yield mnt
    finally:
        gc.collect()
        unmount(mnt)
        os.rmdir(mnt)


@unittest.skipIf(HF_REASON, HF_REASON or "")
class HuggingFace(CkptTestCase):
    def save_model_dir(self):
        model = tiny_model()
        d = self.path("hf-model")
        model.save_pretrained(d, max_shard_size="40KB")  # several shards and an index
        tiny_tokenizer().save_pretrained(d)
        return model, d

    def test_a_save_pretrained_directory_imports_as_one_checkpoint(self):
        model, d = self.save_model_dir()
        files = sorted(os.listdir(d))
        shards = [f for f in files if f.endswith(".safetensors")]
        self.assertGreater(len(shards), 1, files)
        self.assertIn("model.safetensors.index.json", files)
        self.run_ckpt("init")
        self.run_ckpt("import", "tiny", d, "--step", "5")
        shown = ckptfs.open(self.repo).show("tiny")
        self.assertEqual(sorted(t["name"] for t in shown["tensors"]), sorted(model.state_dict()))
        blobs = sorted(b["name"] for b in shown["blobs"])
        self.assertEqual(blobs, sorted(f for f in files if not f.endswith((".safetensors", ".index.json"))))
        self.assertIn("config.json", blobs)
        self.assertIn("generation_config.json", blobs)
        self.assertIn("tokenizer.json", blobs)
        repo = ckptfs.open(self.repo)
        for name, tensor in model.state_dict().items():
            self.assertTrue(torch.equal(repo.tensor("tiny", name), tensor), name)
        with open(os.path.join(d, "config.json"), "rb") as f:
            self.assertEqual(repo.blob("tiny", "config.json"), f.read())

    def test_an_index_that_does_not_match_the_files_is_refused_before_anything_is_written(self):
        _, d = self.save_model_dir()
        index_path = os.path.join(d, "model.safetensors.index.json")
        with open(index_path) as f:
            index = json.load(f)
        name = sorted(index["weight_map"])[0]
        index["weight_map"]["model.not.there"] = index["weight_map"][name]
        with open(index_path, "w") as f:
            json.dump(index, f)
        self.run_ckpt("init")
        err = self.error_of("import", "tiny", d)
        self.assertIn("names tensor 'model.not.there'", err)
        self.assertEqual(ckptfs.open(self.repo).checkpoints(include_pending=True), [])

    @unittest.skipUnless(HAVE_FUSE, "no FUSE here (/dev/fuse, fusermount3)")
    def test_a_training_checkpoint_mounts_a_model_view_that_from_pretrained_loads(self):
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        import ckptfs.torch as ckptfs_torch  # noqa: PLC0415

        model = tiny_model()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optim.step()
        config = model.config.to_json_string().encode()
        state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 3}
        self.run_ckpt("init")
        dcp.save(state, storage_writer=ckptfs_torch.StorageWriter(self.repo, "train", blobs={"config.json": config}),
                 no_dist=True)
        with mounted(self) as mnt:
            here = os.path.join(mnt, "train")
            self.assertIn("model", os.listdir(here))
            view = os.path.join(here, "model")
            files = sorted(os.listdir(view))
            self.assertIn("config.json", files)
            self.assertIn("model.safetensors", files)
            # The model's tensors, named as the model names them; nothing of the optimizer.
            self.assertFalse([f for f in files if f.startswith(("optim", "model.model."))], files)
            self.assertIn("lm_head.weight.npy", files)
            assert_loads_like(self, view, model, torch.tensor([[1, 5, 9, 33, 70]]))
            # A model directory of its own has no such view.
            self.assertNotIn("model", os.listdir(os.path.join(mnt, "train", "model")))

    @unittest.skipUnless(HAVE_FUSE, "no FUSE here (/dev/fuse, fusermount3)")
    def test_from_pretrained_loads_the_mounted_checkpoint_with_identical_logits(self):
        model, d = self.save_model_dir()
        self.run_ckpt("init")
        self.run_ckpt("import", "tiny", d)
        with mounted(self) as mnt:
            here = os.path.join(mnt, "tiny")
            for f in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
                self.assertTrue(os.path.isfile(os.path.join(here, f)) and not os.path.islink(os.path.join(here, f)), f)
            tokenizer = transformers.AutoTokenizer.from_pretrained(here)
            ids = tokenizer("w1 w5 w9 w33 w70", return_tensors="pt")["input_ids"]
            loaded = assert_loads_like(self, here, model, ids)
            for name, tensor in model.state_dict().items():
                self.assertTrue(torch.equal(loaded.state_dict()[name], tensor), name)
            del loaded, tokenizer


if __name__ == "__main__":
    unittest.main()
