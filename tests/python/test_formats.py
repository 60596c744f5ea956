"""Checkpoints of other formats imported as they are (ckptfs.formats and
`ckpt import`): DCP directories written by stock dcp.save with
FileSystemWriter at several world sizes (each rank a process, gloo), and
torch.save files; bad inputs give one clear error and leave nothing
visible. The inputs are made by torch itself in the test."""
import collections
import json
import os
import subprocess
import sys
import unittest
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
import ckptfs.formats as formats  # noqa: E402
import dcp_worker  # noqa: E402
from helpers import CKPT  # noqa: E402
from test_dcp import DCP_REASON, DcpTestCase  # noqa: E402


def run_ckpt(test, repo, *args, ok=True):
    """`ckpt ARGS` on `repo`, handing the torch formats to this Python;
    with `ok`, fails `test` unless it exits 0."""
    env = dict(os.environ, CKPT_REPO=repo, CKPT_PYTHON=sys.executable)
    p = subprocess.run([CKPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=300)
    if ok:
        test.assertEqual(p.returncode, 0, p.stderr.decode())
    return p


def same(a, b):
    """Whether two objects of tensors, dicts (keys in order, of the same
    types), lists, tuples and plain values are equal, bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def export_dying_at_the_second_shard(test, repo, name, out):
    """An hf export of checkpoint `name` into `out` (20 KB shards, one
    thread) whose fourth durable write fails (the progress file, the first
    shard, the progress file, then the second shard): the basenames of the
    writes begun, in order."""
    calls = []
    real = formats.writing.write_durable

    def dies(path, write):
        calls.append(os.path.basename(path))
        if len(calls) == 4:
            raise OSError("disk went away")
        return real(path, write)

    formats.writing.write_durable = dies
    try:
        with test.assertRaises(OSError):
            formats.export_checkpoint(repo, name, out, format="hf", max_shard_size="20KB", threads=1)
    finally:
        formats.writing.write_durable = real
    return calls


def dcp_worker_items(path):
    """The items a DCP directory's .metadata names."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    return list(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@unittest.skipIf(DCP_REASON, DCP_REASON or "")
class DcpDirectories(DcpTestCase):
    def setUp(self):
        super().setUp()
        # Small chunks: the test's tensors span many.
        self.repo = self.path("small")
        ckptfs.init(self.repo, chunk_size=64 << 10, pack_size=1 << 20)
        self.r = ckptfs.open(self.repo)

    def save_files(self, world, what):
        out = self.path(f"dcp-{what}-{world}")
        self.assertEqual(self.run_job(world, "save-files", out, what), ["ok"] * world)
        return out

    def ckpt(self, *args, ok=True):
        return run_ckpt(self, self.repo, *args, ok=ok)

    def test_dcp_checkpoints_of_4_and_2_ranks_import_as_saved_and_share_their_chunks(self):
        four, two = self.save_files(4, "big"), self.save_files(2, "big")
        # A dry run lists what would come in and writes nothing.
        dry = json.loads(self.ckpt("import", "w4", four, "--dry-run", "--json").stdout)
        self.assertEqual(dry["format"], "dcp")
        self.assertEqual({t["name"]: t["shards"] for t in dry["tensors"]},
                         {"layers.0.weight": 4, "embed.weight": 1, "layers.0.out.weight": 4, "layers.0.mlp.weight": 4})
        self.assertEqual([c["name"] for c in self.r.checkpoints()], [])
        # Through the CLI (which hands DCP to the Python package) and the API.
        p = self.ckpt("import", "w4", four, "--step", "77", "--progress=json")
        lines = [json.loads(x) for x in p.stderr.decode().splitlines()]
        self.assertTrue(lines and lines[-1]["finished"], lines)
        self.assertEqual(lines[-1]["done_bytes"], lines[-1]["total_bytes"])
        self.assertEqual(lines[-1]["total_bytes"], dry["tensor_bytes"])
        first = formats.import_checkpoint(self.r, "w2", two, step=77)
        self.assertTrue(first["committed"])
        want = dcp_worker.big()
        for name in ("w4", "w2"):
            for key, t in want.items():
                got = self.r.tensor(name, key)
                self.assertEqual(got.dtype, t.dtype)
                self.assertTrue(torch.equal(bits(got), bits(t)), (name, key))
            # the non-tensor item is DCP's pickle of it, as DCP wrote it
            self.assertEqual(torch.load(__import__("io").BytesIO(self.r.blob(name, "step")), weights_only=True), 77)
        shards = {t["name"]: len(t["shards"]) for t in self.r.show("w4")["tensors"]}
        self.assertEqual(shards["layers.0.weight"], 4)
        # Column blocks and a 2-D mesh's boxes are kept as tiles of a grid
        # of the tensor (more shard records than ranks), shown as the ranks cut it.
        self.assertGreater(shards["layers.0.out.weight"], 4)
        for name, want_placement in (("w4", {"layers.0.weight": "4 row blocks", "layers.0.out.weight": "4 column blocks",
                                             "layers.0.mlp.weight": "4 boxes"}),
                                     ("w2", {"layers.0.weight": "2 row blocks", "layers.0.out.weight": "2 column blocks",
                                             "layers.0.mlp.weight": "2 column blocks"})):
            placement = {t["name"]: t["placement"] for t in self.r.show(name)["tensors"]}
            self.assertEqual({k: placement[k] for k in want_placement}, want_placement, name)
        # The world-size-2 copy stored almost nothing new, whatever the
        # placement (rows, columns, a 2-D mesh): its chunks are the
        # world-size-4 copy's (the blob holds DCP's pickle, a few bytes).
        logical = sum(t.numel() * t.element_size() for t in want.values())
        self.assertLess(first["stored_bytes"], logical * 0.01, first)
        du = {c["name"]: c for c in json.loads(self.ckpt("du", "--json").stdout)["checkpoints"]}
        self.assertLess(du["w2"]["exclusive_bytes"], logical * 0.01, du)

    def test_the_per_rank_files_of_torchs_huggingface_writer_import_as_whole_tensors(self):
        # HuggingFaceStorageWriter(save_distributed=True): one safetensors
        # file per rank, each tensor placed by DCP_SHARDING_INFO's offsets,
        # no global shapes; the engine reads them without torch.
        src = self.path("hf-per-rank")
        self.assertEqual(self.run_job(4, "save-hf", src), ["ok"] * 4)
        self.assertEqual(len([n for n in os.listdir(src) if n.endswith(".safetensors")]), 4)
        dry = json.loads(self.ckpt("import", "hfw", src, "--dry-run", "--json").stdout)
        want = {k: v for k, v in dcp_worker.full().items()}
        self.assertEqual({t["name"]: t["shape"] for t in dry["tensors"]}, {k: list(v.shape) for k, v in want.items()})
        self.ckpt("import", "hfw", src)
        for key, t in want.items():
            got = self.r.tensor("hfw", key)
            self.assertEqual(got.dtype, t.dtype, key)
            self.assertTrue(torch.equal(bits(got), bits(t)), key)
        self.assertEqual(len(next(x for x in self.r.show("hfw")["tensors"] if x["name"] == "rows")["shards"]), 4)
        # Without the last rank's file the shards left do not tile the
        # tensors they name: refused, and nothing shows.
        part = self.path("hf-three")
        os.makedirs(part)
        for n in sorted(os.listdir(src))[:3]:
            os.link(os.path.join(src, n), os.path.join(part, n))
        p = self.ckpt("import", "three", part, ok=False)
        self.assertEqual(p.returncode, 1)
        self.assertEqual(len(p.stderr.decode().strip().splitlines()), 1, p.stderr.decode())
        self.assertNotIn("three", [c["name"] for c in self.r.checkpoints(include_pending=True)])

    def test_a_dcp_directory_on_the_repositorys_disk_is_imported_with_every_chunk_compressed(self):
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        # fp32 moments: byte grouping saves about 16 %, which the adaptive
        # codec skips while the pack writers keep up; an import reading its
        # source from the same disk compresses them.
        gen = torch.Generator().manual_seed(12)
        state = {f"optim.{i}.exp_avg": torch.randn(256, 1024, generator=gen) * 1e-3 for i in range(4)}
        src = self.path("moments")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
        self.assertTrue(formats.importing.on_the_repositorys_disk(self.r, src))
        on_s3 = ckptfs.Repository(type("S3", (), {"path": "s3://b/p"})())
        self.assertFalse(formats.importing.on_the_repositorys_disk(on_s3, src))
        got = formats.import_checkpoint(self.r, "moments", src)
        logical = sum(t.numel() * 4 for t in state.values())
        self.assertLess(got["stored_bytes"], logical * 0.85, got)
        for key, t in state.items():
            self.assertTrue(torch.equal(self.r.tensor("moments", key), t), key)

    def test_every_placement_imports_and_loads_through_dcp_at_another_world_size(self):
        four = self.save_files(4, "placements")
        formats.import_checkpoint(self.r, "p", four, step=1234)
        self.assertEqual(self.run_job(3, "load", self.repo, "p"), ["ok"] * 3)
        # Exported as a DCP directory again, stock dcp.load reads it at 2 ranks.
        out = self.path("exported")
        self.ckpt("export", "p", out, "--format", "dcp")
        self.assertEqual(self.run_job(2, "load-files", out, "p"), ["ok"] * 2)

    def test_items_read_in_place_and_through_torch_import_alike(self):
        """FileSystemWriter items of contiguous tensors are put straight
        from their files; a transposed tensor, an empty one and a 0-d one go
        through torch's reader. All come back bit-exact."""
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: PLC0415
        from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: PLC0415

        gen = torch.Generator().manual_seed(3)
        sd = {
            "plain": torch.randn(300, 70, generator=gen),
            "half": torch.randn(33, 65, generator=gen).to(torch.bfloat16),
            "transposed": torch.randn(40, 24, generator=gen).t(),
            "empty": torch.zeros(0, 5),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
        }
        out = self.path("single")
        dcp.save(sd, storage_writer=FileSystemWriter(out), no_dist=True)
        reader = FileSystemReader(out)
        md = reader.read_metadata()
        where = {}
        for fqn in ("plain", "half", "transposed"):
            info = md.storage_data[MetadataIndex(fqn, md.state_dict_metadata[fqn].chunks[0].offsets, 0)]
            with open(os.path.join(out, info.relative_path), "rb") as f:
                where[fqn] = formats.dcp_in.raw_tensor_at(torch, f, info, sd[fqn].dtype, sd[fqn].shape)
                if where[fqn] is not None:
                    f.seek(where[fqn])
                    raw = f.read(sd[fqn].numel() * sd[fqn].element_size())
                    self.assertEqual(raw, bytes(sd[fqn].contiguous().view(torch.uint8).numpy()), fqn)
        self.assertIsNotNone(where["plain"])
        self.assertIsNotNone(where["half"])
        self.assertIsNone(where["transposed"])  # strides other than row-major: torch reads it
        formats.import_checkpoint(self.r, "single", out)
        for key, t in sd.items():
            got = self.r.tensor("single", key)
            self.assertEqual(got.dtype, t.dtype, key)
            self.assertEqual(tuple(got.shape), tuple(t.shape), key)
            self.assertTrue(torch.equal(bits(got), bits(t.contiguous())), key)

    def test_a_nested_dcp_state_comes_back_nested_from_dcp_and_torch_exports(self):
        # dcp.save flattens a nested state (model, optimizer, param_groups,
        # plain values) and records each item's object path; the exports
        # give the same object back: through dcp_to_torch_save of a DCP
        # export, and as a torch export.
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: PLC0415

        gen = torch.Generator().manual_seed(2)
        state = {"model": {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32).to(torch.bfloat16)},
                 "optim": {"state": {"w": {"exp_avg": torch.randn(64, 32, generator=gen), "step": torch.tensor(3.0)}},
                           "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]},
                 "step": 7}
        src = self.path("nested")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
        self.ckpt("import", "n", src)
        self.assertIn(formats.STRUCTURE_BLOB, {b["name"] for b in self.r.show("n")["blobs"]})
        want = self.path("want.pt")
        dcp_to_torch_save(src, want)
        out = self.path("nested-dcp")
        self.ckpt("export", "n", out, "--format", "dcp")
        got = self.path("got.pt")
        dcp_to_torch_save(out, got)
        self.assertTrue(same(torch.load(want, weights_only=False), torch.load(got, weights_only=False)))
        # A model directory gets the tensors, not the state's other values.
        hf = self.path("nested-hf")
        p = self.ckpt("export", "n", hf, "--format", "hf", "--json")
        self.assertEqual(sorted(os.listdir(hf)), ["model.safetensors"])
        left = json.loads(p.stdout)["left_out"]
        self.assertEqual(sorted(x.split()[1] for x in left),
                         ["optim.param_groups.0.betas", "optim.param_groups.0.lr", "optim.param_groups.0.params",
                          "step"])
        self.assertIn("ckpt export: leaving out blob step (a non-tensor value of the state", p.stderr.decode())
        tout = self.path("nested-torch")
        self.ckpt("export", "n", tout, "--format", "torch")
        self.assertTrue(same(torch.load(want, weights_only=False),
                             torch.load(os.path.join(tout, "model.pt"), weights_only=True)))

    def test_files_beside_a_dcp_checkpoint_import_as_blobs_and_export_as_files(self):
        # Megatron-Core's torch_dist directories hold common.pt and
        # metadata.json beside DCP's files; Megatron reads both back.
        src = self.save_files(2, "big")
        common = {"iteration": 100, "args": {"tensor_model_parallel_size": 2}}
        torch.save(common, os.path.join(src, "common.pt"))
        with open(os.path.join(src, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
        os.makedirs(os.path.join(src, "extra"))
        with open(os.path.join(src, "__7_0.distcp"), "wb") as f:
            f.write(b"not named by .metadata")
        p = self.ckpt("import", "meg", src)
        err = p.stderr.decode()
        self.assertIn(f"leaving out {os.path.join(src, 'extra')} (a directory)", err)
        self.assertIn("__7_0.distcp (a .distcp file the .metadata does not name)", err)
        items = set(dcp_worker_items(src))  # DCP's own items: tensors and a step
        self.assertEqual({b["name"] for b in self.r.show("meg")["blobs"]},
                         {"common.pt", "metadata.json", formats.DCP_FILES_BLOB, formats.STRUCTURE_BLOB}
                         | (items - set(dcp_worker.big())))
        out = self.path("meg-out")
        self.ckpt("export", "meg", out, "--format", "dcp")
        self.assertEqual(sorted(n for n in os.listdir(out) if not n.endswith(".distcp")),
                         [".metadata", "common.pt", "metadata.json"])
        for n in ("common.pt", "metadata.json"):
            with open(os.path.join(src, n), "rb") as a, open(os.path.join(out, n), "rb") as b:
                self.assertEqual(a.read(), b.read(), n)
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        want = dcp_worker.big()
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(got, storage_reader=dcp.FileSystemReader(out), no_dist=True)
        for k, v in want.items():
            self.assertTrue(torch.equal(bits(got[k]), bits(v)), k)
        self.assertEqual(set(dcp_worker_items(out)), items)
        self.assertEqual(torch.load(os.path.join(out, "common.pt"), weights_only=True), common)
        # Other exports leave the list of those files out.
        hf = self.path("meg-hf")
        self.ckpt("export", "meg", hf, "--format", "hf")
        self.assertNotIn(formats.DCP_FILES_BLOB, os.listdir(hf))
        self.assertIn("common.pt", os.listdir(hf))

    def test_a_dcp_directory_with_a_missing_or_truncated_file_is_refused_and_nothing_shows(self):
        four = self.save_files(4, "big")
        victim = os.path.join(four, "__1_0.distcp")
        with open(victim, "rb") as f:
            data = f.read()
        with open(victim, "wb") as f:
            f.write(data[: len(data) // 2])
        err = self.ckpt("import", "bad", four, ok=False).stderr.decode().strip()
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("cannot read the DCP data", err)
        os.unlink(victim)
        err = self.ckpt("import", "bad", four, ok=False).stderr.decode().strip()
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("__1_0.distcp, which is missing", err)
        # A .metadata naming a file outside its directory (which exists).
        with open(victim, "wb") as f:
            f.write(data)
        import dataclasses  # noqa: PLC0415
        import pickle  # noqa: PLC0415

        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        md = dcp.FileSystemReader(four).read_metadata()
        os.replace(os.path.join(four, "__0_0.distcp"), self.path("outside.distcp"))
        md.storage_data = {k: (dataclasses.replace(v, relative_path="../outside.distcp")
                               if v.relative_path == "__0_0.distcp" else v) for k, v in md.storage_data.items()}
        with open(os.path.join(four, ".metadata"), "wb") as f:
            pickle.dump(md, f)
        err = self.ckpt("import", "bad", four, ok=False).stderr.decode().strip()
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("names '../outside.distcp', which is outside the directory", err)
        self.assertEqual(self.r.checkpoints(include_pending=True), [])


try:
    import lightning as L  # noqa: E402, N812

    LIGHTNING_REASON = None
except ImportError as e:
    LIGHTNING_REASON = f"lightning is not importable: {e}"

try:
    import transformers  # noqa: E402

    from test_huggingface import tiny_model  # noqa: E402
    HF_REASON = None
except ImportError as e:
    HF_REASON = f"transformers is not importable: {e}"


class Exports(unittest.TestCase):
    """ckpt export --format hf, dcp and torch, and their resumption."""

    def setUp(self):
        import tempfile  # noqa: PLC0415

        self.tmp = tempfile.mkdtemp(prefix="ckptfs-export-")
        self.path = os.path.join(self.tmp, "repo")
        self.repo = ckptfs.init(self.path, chunk_size=64 << 10)

    def tearDown(self):
        import shutil  # noqa: PLC0415

        shutil.rmtree(self.tmp, ignore_errors=True)

    def ckpt(self, *args, ok=True):
        return run_ckpt(self, self.path, *args, ok=ok)

    @unittest.skipIf(HF_REASON, HF_REASON or "")
    def test_a_model_directory_whose_index_names_a_missing_shard_is_refused(self):
        src = os.path.join(self.tmp, "hf")
        tiny_model().save_pretrained(src, max_shard_size="20KB")
        with open(os.path.join(src, "model.safetensors.index.json")) as f:
            victim = sorted(set(json.load(f)["weight_map"].values()))[1]
        os.unlink(os.path.join(src, victim))
        err = self.ckpt("import", "m", src, ok=False).stderr.decode().strip()
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("model.safetensors.index.json", err)
        self.assertEqual(self.repo.checkpoints(include_pending=True), [])

    def torch_weights_directory(self, model, name="bin"):
        """`model` as transformers wrote models before safetensors: its
        weights in two torch.save shards named by pytorch_model.bin.index.json,
        beside config.json (and a subdirectory, which is left out)."""
        src = os.path.join(self.tmp, name)
        model.config.save_pretrained(src)
        os.makedirs(os.path.join(src, "runs"))
        sd = model.state_dict()
        keys = list(sd)
        parts = [keys[:len(keys) // 2], keys[len(keys) // 2:]]
        weight_map = {}
        for i, part in enumerate(parts):
            fname = f"pytorch_model-{i + 1:05d}-of-{len(parts):05d}.bin"
            torch.save({k: sd[k].clone() for k in part}, os.path.join(src, fname))
            weight_map.update({k: fname for k in part})
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
                 "weight_map": weight_map}
        with open(os.path.join(src, "pytorch_model.bin.index.json"), "w") as f:
            json.dump(index, f)
        return src, weight_map

    @unittest.skipIf(HF_REASON, HF_REASON or "")
    def test_a_dry_run_of_a_model_directory_lists_its_tensors_and_writes_nothing(self):
        model = tiny_model()
        src = os.path.join(self.tmp, "hf")
        model.save_pretrained(src)
        os.makedirs(os.path.join(src, "runs"))
        dry = formats.import_checkpoint(self.repo, "m", src, dry_run=True)
        self.assertEqual((dry["format"], dry["committed"]), ("hf", False))
        sd = model.state_dict()
        self.assertEqual({t["name"]: t["shape"] for t in dry["tensors"]}, {k: list(v.shape) for k, v in sd.items()})
        self.assertEqual(dry["tensor_bytes"], sum(v.numel() * v.element_size() for v in sd.values()))
        self.assertIn("config.json", [b["name"] for b in dry["blobs"]])
        self.assertEqual(dry["left_out"], [f"{os.path.join(src, 'runs')} (a directory)"])
        self.assertEqual(self.repo.checkpoints(include_pending=True), [])

    @unittest.skipIf(HF_REASON, HF_REASON or "")
    def test_a_model_directory_of_torch_weights_imports_and_exports_with_identical_logits(self):
        model = tiny_model()
        src, weight_map = self.torch_weights_directory(model)
        p = self.ckpt("import", "m", src)
        self.assertIn(f"leaving out {os.path.join(src, 'runs')} (a directory)", p.stderr.decode())
        shown = self.repo.show("m")
        self.assertEqual(sorted(t["name"] for t in shown["tensors"]), sorted(weight_map))
        self.assertEqual([b["name"] for b in shown["blobs"]], ["config.json"])
        out = os.path.join(self.tmp, "out")
        self.ckpt("export", "m", out, "--format", "hf")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        ids = torch.tensor([[1, 5, 9, 33, 2]])
        with torch.no_grad():
            self.assertTrue(torch.equal(model(ids).logits, loaded(ids).logits))
        # The same model saved with safetensors shares every tensor's chunk
        # (each tensor is one); only its config files are new.
        model.save_pretrained(os.path.join(self.tmp, "st"))
        summary = self.repo.import_safetensors("st", [os.path.join(self.tmp, "st")])
        self.assertEqual(summary["chunks_deduplicated"], len(weight_map), summary)
        self.assertLessEqual(summary["chunks_written"], 2, summary)

    @unittest.skipIf(HF_REASON, HF_REASON or "")
    def test_a_model_directory_of_torch_weights_with_a_bad_part_is_refused(self):
        model = tiny_model()
        src, weight_map = self.torch_weights_directory(model)
        index_path = os.path.join(src, "pytorch_model.bin.index.json")
        with open(index_path) as f:
            index = json.load(f)
        first, second = sorted(set(weight_map.values()))
        moved = dict(index, weight_map=dict(weight_map, **{next(iter(weight_map)): second}))
        with open(index_path, "w") as f:
            json.dump(moved, f)
        self.refused(src, f"places tensor '{next(iter(weight_map))}' in {second}")
        with open(index_path, "w") as f:
            json.dump(index, f)
        torch.save({"w": torch.ones(2), "step": 3}, os.path.join(src, first))
        self.refused(src, "entry 'step' is a int, not a tensor")
        os.unlink(os.path.join(src, first))
        self.refused(src, f"names shard {first}, which is missing")
        # The engine's own importer refuses it, saying what reads it.
        with self.assertRaisesRegex(ckptfs.UnsupportedError, "torch.save files"):
            self.repo.import_safetensors("m", [src])

    def refused(self, src, message):
        err = self.ckpt("import", "m", src, ok=False).stderr.decode().strip()
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn(message, err)
        self.assertEqual(self.repo.checkpoints(include_pending=True), [])

    @unittest.skipIf(HF_REASON, HF_REASON or "")
    def test_torch_weights_beside_safetensors_ones_are_left_out(self):
        model = tiny_model()
        src = os.path.join(self.tmp, "both")
        model.save_pretrained(src)
        torch.save(model.state_dict(), os.path.join(src, "pytorch_model.bin"))
        p = self.ckpt("import", "m", src)
        self.assertIn("pytorch_model.bin (torch.save weights; the directory's safetensors files are imported)",
                      p.stderr.decode())
        shown = self.repo.show("m")
        self.assertNotIn("pytorch_model.bin", [b["name"] for b in shown["blobs"]])
        self.assertEqual(len(shown["tensors"]), len(model.state_dict()))

    @unittest.skipIf(HF_REASON, HF_REASON or "")
    def test_a_trainer_checkpoint_round_trips_and_training_resumes_from_the_export_alike(self):
        class Tokens(torch.utils.data.Dataset):
            def __len__(self):
                return 32

            def __getitem__(self, i):
                ids = torch.randint(0, 96, (8,), generator=torch.Generator().manual_seed(i))
                return {"input_ids": ids, "labels": ids}

        def trainer(out, steps):
            args = transformers.TrainingArguments(out, max_steps=steps, per_device_train_batch_size=4, save_steps=2,
                                                  report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
            return transformers.Trainer(model=tiny_model(), args=args, train_dataset=Tokens())

        trainer(os.path.join(self.tmp, "run"), 2).train()
        src = os.path.join(self.tmp, "run", "checkpoint-2")
        self.ckpt("import", "c2", src)
        out = os.path.join(self.tmp, "exported")
        self.ckpt("export", "c2", out, "--format", "hf")
        self.assertEqual(sorted(os.listdir(out)), sorted(os.listdir(src)))
        for n in os.listdir(src):  # the trainer's files come back as they were
            if n != "model.safetensors":
                with open(os.path.join(src, n), "rb") as a, open(os.path.join(out, n), "rb") as b:
                    self.assertEqual(a.read(), b.read(), n)
        resumed = []
        for ckpt in (src, out):
            t = trainer(os.path.join(self.tmp, "resumed"), 4)
            t.train(resume_from_checkpoint=ckpt)
            self.assertEqual(t.state.global_step, 4)
            resumed.append(t.model.state_dict())
        for k, v in resumed[0].items():
            self.assertTrue(torch.equal(v, resumed[1][k]), k)

    @unittest.skipIf(HF_REASON, HF_REASON or "")
    def test_a_file_of_over_a_gib_beside_the_weights_is_a_blob_streamed_both_ways(self):
        # A trainer's checkpoint directory: the model's safetensors beside
        # an optimizer.pt of many GB, here a sparse file of 1 GiB + 1 MiB
        # with marks at both ends.
        src = os.path.join(self.tmp, "trainer")
        tiny_model().save_pretrained(src)
        big = os.path.join(src, "optimizer.pt")
        size = (1 << 30) + (1 << 20)
        with open(big, "wb") as f:
            f.write(b"head")
            f.seek(size - 4)
            f.write(b"tail")
        self.ckpt("import", "t", src)
        self.assertIn({"name": "optimizer.pt", "bytes": size}, self.repo.show("t")["blobs"])
        out = os.path.join(self.tmp, "out")
        # The export, in a process of its own: it writes the blob in pieces
        # through one buffer, so its peak memory stays far below the blob.
        code = ("import resource, sys, ckptfs, ckptfs.formats as f; "
                "f.export_checkpoint(ckptfs.open(sys.argv[1]), 't', sys.argv[2], format='hf'); "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
        p = subprocess.run([sys.executable, "-c", code, self.path, out], stdout=subprocess.PIPE, check=True,
                           timeout=300)
        peak_kib = int(p.stdout.decode().split()[-1])
        self.assertLess(peak_kib << 10, 900 << 20)
        self.assertEqual(os.path.getsize(os.path.join(out, "optimizer.pt")), size)
        with open(os.path.join(out, "optimizer.pt"), "rb") as f:
            self.assertEqual(f.read(4), b"head")
            f.seek(size - 4)
            self.assertEqual(f.read(4), b"tail")
        os.unlink(big)

    @unittest.skipIf(HF_REASON, HF_REASON or "")
    def test_a_model_directory_exports_as_hf_and_loads_with_identical_logits(self):
        model = tiny_model()
        src = os.path.join(self.tmp, "hf")
        model.save_pretrained(src, max_shard_size="20KB")
        with open(os.path.join(src, "model.safetensors.index.json")) as f:
            theirs = json.load(f)
        self.ckpt("import", "m", src)
        out = os.path.join(self.tmp, "out")
        p = self.ckpt("export", "m", out, "--format", "hf", "--max-shard-size", "20KB", "--json", "--progress=json")
        done = json.loads(p.stdout)
        last = json.loads(p.stderr.decode().splitlines()[-1])
        self.assertEqual((last["progress"], last["finished"]), ("export m", True))
        self.assertEqual(last["done_bytes"], last["total_bytes"])
        self.assertFalse(os.path.exists(out + formats.PARTIAL_SUFFIX))
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            ours = json.load(f)
        self.assertEqual(ours["metadata"]["total_size"], theirs["metadata"]["total_size"])
        # The same split as save_pretrained's: its greedy rule over the
        # model's state-dict order (from config.json, built on meta).
        self.assertEqual(ours["weight_map"], theirs["weight_map"])
        for name in set(ours["weight_map"].values()):
            with open(os.path.join(out, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            self.assertEqual(header["__metadata__"]["format"], "pt")
        self.assertIn("config.json", done["files"])
        # At another size too, where the split is not the names' order.
        model.save_pretrained(os.path.join(self.tmp, "hf7"), max_shard_size="7KB")
        self.ckpt("export", "m", os.path.join(self.tmp, "out7"), "--format", "hf", "--max-shard-size", "7KB")
        with open(os.path.join(self.tmp, "hf7", "model.safetensors.index.json")) as f:
            theirs7 = json.load(f)
        with open(os.path.join(self.tmp, "out7", "model.safetensors.index.json")) as f:
            self.assertEqual(json.load(f), theirs7)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        ids = torch.tensor([[1, 5, 9, 33, 2]])
        with torch.no_grad():
            self.assertTrue(torch.equal(model(ids).logits, loaded(ids).logits))
        # --dtype casts the floating tensors, for a release.
        half = os.path.join(self.tmp, "half")
        self.ckpt("export", "m", half, "--format", "hf", "--dtype", "bfloat16")
        self.assertTrue(os.path.exists(os.path.join(half, "model.safetensors")))
        w = transformers.AutoModelForCausalLM.from_pretrained(half, dtype=torch.bfloat16)
        self.assertEqual(next(w.parameters()).dtype, torch.bfloat16)

    @unittest.skipIf(HF_REASON or DCP_REASON, HF_REASON or DCP_REASON or "")
    def test_a_training_states_model_exports_as_hf_under_a_prefix_with_identical_logits(self):
        # A training job's DCP checkpoint: {"model": ..., "optim": ...},
        # with the model's config.json beside it.
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.tensor([[1, 5, 9, 33, 2]])
        model.train()
        model(ids, labels=ids).loss.backward()
        opt.step()
        model.eval()
        src = os.path.join(self.tmp, "step-1")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group: one process
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=src)
        model.config.to_json_file(os.path.join(src, "config.json"))
        self.ckpt("import", "step-1", src)
        out = os.path.join(self.tmp, "release")
        p = self.ckpt("export", "step-1", out, "--format", "hf", "--prefix", "model.", "--dtype", "float32", "--json")
        done = json.loads(p.stdout)
        optim = [t["name"] for t in self.repo.show("step-1")["tensors"] if t["name"].startswith("optim.")]
        self.assertTrue(optim)
        self.assertEqual(done["left_out"][0], f"{len(optim)} tensors not named under 'model.'")
        self.assertIn(f"leaving out {len(optim)} tensors not named under 'model.'", p.stderr.decode())
        with open(os.path.join(out, "model.safetensors"), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        self.assertEqual(set(header) - {"__metadata__"}, set(model.state_dict()))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            self.assertTrue(torch.equal(model(ids).logits, loaded(ids).logits))
        # A prefix naming no tensor says which names there are, and writes
        # nothing; --prefix belongs to --format hf.
        p = self.ckpt("export", "step-1", os.path.join(self.tmp, "none"), "--format", "hf", "--prefix", "modle.",
                      ok=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn("no tensor of 'step-1' is named under 'modle.'; its tensors' names begin with model., optim.",
                      p.stderr.decode())
        self.assertEqual(sorted(os.listdir(self.tmp)), ["release", "repo", "step-1"])
        for fmt in ("dcp", "safetensors"):
            p = self.ckpt("export", "step-1", os.path.join(self.tmp, "x"), "--format", fmt, "--prefix", "model.",
                          ok=False)
            self.assertEqual(p.returncode, 2)
            self.assertIn("--prefix is for --format hf", p.stderr.decode())

    def test_dcp_and_torch_exports_load_with_torch_bit_exact(self):
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        gen = torch.Generator().manual_seed(9)
        state = {"w": torch.randn(300, 200, generator=gen), "b": torch.randn(77, generator=gen).to(torch.bfloat16),
                 "n": {"count": torch.arange(10)}, "epoch": 4}
        path = os.path.join(self.tmp, "state.pt")
        torch.save(state, path)
        self.ckpt("import", "t", path)
        out = os.path.join(self.tmp, "dcp")
        self.ckpt("export", "t", out, "--format", "dcp")
        target = {"w": torch.zeros(300, 200), "b": torch.zeros(77, dtype=torch.bfloat16),
                  "n.count": torch.zeros(10, dtype=torch.int64)}
        dcp.load(target, storage_reader=dcp.FileSystemReader(out), no_dist=True)
        self.assertTrue(torch.equal(target["w"], state["w"]))
        self.assertTrue(torch.equal(bits(target["b"]), bits(state["b"])))
        self.assertTrue(torch.equal(target["n.count"], state["n"]["count"]))
        tout = os.path.join(self.tmp, "torch")
        self.ckpt("export", "t", tout + "/", "--format", "torch")  # a trailing slash names the same directory
        back = torch.load(os.path.join(tout, "model.pt"), weights_only=True)
        self.assertEqual(list(back), ["w", "b", "n", "epoch"])
        self.assertEqual(back["epoch"], 4)
        self.assertTrue(torch.equal(back["n"]["count"], state["n"]["count"]))
        self.assertTrue(torch.equal(bits(back["b"]), bits(state["b"])))
        # Nothing is replaced.
        err = self.ckpt("export", "t", tout, "--format", "torch", ok=False).stderr.decode().strip()
        self.assertIn("exists", err)
        self.assertEqual(len(err.splitlines()), 1)

    def test_hf_export_streams_tensors_in_pieces_bit_exact_and_cast(self):
        # Pieces of 4 KiB: every tensor but the empty and 0-d ones takes
        # several, read ahead while the last is written.
        from safetensors.torch import load_file  # noqa: PLC0415

        gen = torch.Generator().manual_seed(9)
        state = {"w": torch.randn(100, 37, generator=gen), "h": torch.randn(3001, generator=gen).to(torch.bfloat16),
                 "i": torch.arange(5000, dtype=torch.int64), "e": torch.zeros(0, 4), "s": torch.tensor(2.5)}
        self.repo.save("m", state)
        piece = formats.writing.EXPORT_PIECE
        formats.writing.EXPORT_PIECE = 4096
        try:
            out = formats.export_checkpoint(self.repo, "m", os.path.join(self.tmp, "plain"), format="hf")
            cast = formats.export_checkpoint(self.repo, "m", os.path.join(self.tmp, "bf16"), format="hf",
                                             dtype="bfloat16")
        finally:
            formats.writing.EXPORT_PIECE = piece
        self.assertEqual(out["files"], ["model.safetensors"])
        got = load_file(os.path.join(self.tmp, "plain", "model.safetensors"))
        self.assertEqual(set(got), set(state))
        for k, v in state.items():
            self.assertEqual(got[k].dtype, v.dtype, k)
            self.assertTrue(torch.equal(bits(got[k]), bits(v)), k)
        got = load_file(os.path.join(self.tmp, "bf16", cast["files"][0]))
        for k, v in state.items():
            want = v.to(torch.bfloat16) if v.is_floating_point() else v
            self.assertEqual(got[k].dtype, want.dtype, k)
            self.assertTrue(torch.equal(bits(got[k]), bits(want)), k)

    def test_an_interrupted_hf_export_resumes_without_redoing_finished_files(self):
        gen = torch.Generator().manual_seed(4)
        self.repo.save("big", {f"layer{i}": torch.randn(64, 64, generator=gen) for i in range(8)})
        out = os.path.join(self.tmp, "out")
        calls = export_dying_at_the_second_shard(self, self.repo, "big", out)
        # The export stopped at the failure: no shard after it was started.
        self.assertEqual(calls, [formats.common.PROGRESS_FILE, "model-00001-of-00008.safetensors",
                                 formats.common.PROGRESS_FILE, "model-00002-of-00008.safetensors"])
        self.assertFalse(os.path.exists(out))
        self.assertTrue(os.path.isdir(out + formats.PARTIAL_SUFFIX))
        # Other options: refused, naming the partial directory.
        with self.assertRaises(ckptfs.AlreadyExistsError) as e:
            formats.export_checkpoint(self.repo, "big", out, format="hf", max_shard_size="40KB")
        self.assertIn(formats.PARTIAL_SUFFIX, str(e.exception))
        done = formats.export_checkpoint(self.repo, "big", out, format="hf", max_shard_size="20KB")
        self.assertEqual(done["resumed_files"], 1)
        self.assertEqual(len(done["files"]), 9)  # 8 shards and the index
        fresh = formats.export_checkpoint(self.repo, "big", os.path.join(self.tmp, "fresh"), format="hf",
                                          max_shard_size="20KB")
        for f in fresh["files"]:
            with open(os.path.join(out, f), "rb") as a, open(os.path.join(self.tmp, "fresh", f), "rb") as b:
                self.assertEqual(a.read(), b.read(), f)
        # --clean starts over.
        export_dying_at_the_second_shard(self, self.repo, "big", os.path.join(self.tmp, "o2"))
        again = formats.export_checkpoint(self.repo, "big", os.path.join(self.tmp, "o2"), format="hf",
                                          max_shard_size="40KB", clean=True)
        self.assertEqual(again["resumed_files"], 0)

    def test_an_interrupted_dcp_export_resumes_and_dcp_load_reads_it(self):
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        gen = torch.Generator().manual_seed(6)
        state = {f"layer{i}": torch.randn(64, 64, generator=gen) for i in range(6)}
        state["norm"] = torch.randn(64, generator=gen).to(torch.bfloat16)
        state["scalar"] = torch.tensor(3, dtype=torch.int64)
        self.repo.save("big", {**state, "note": b"not a pickle"})
        out = os.path.join(self.tmp, "out")
        calls = []
        real, size = formats.writing.write_durable, formats.export_dcp.DCP_FILE_BYTES

        def dies_on_the_second_file(path, write):
            calls.append(os.path.basename(path))
            if len(calls) == 4:  # the progress file, a data file, the progress file, then this one
                raise OSError("disk went away")
            real(path, write)

        formats.writing.write_durable, formats.export_dcp.DCP_FILE_BYTES = dies_on_the_second_file, 40 << 10  # 2 layers a file
        try:
            with self.assertRaises(OSError):
                formats.export_checkpoint(self.repo, "big", out, format="dcp", threads=1)
            # It stopped at the failure: no file after it was started.
            self.assertEqual(calls, [formats.common.PROGRESS_FILE, "__0_0.distcp", formats.common.PROGRESS_FILE, "__0_1.distcp"])
            self.assertFalse(os.path.exists(out))
            self.assertFalse(os.path.exists(os.path.join(out + formats.PARTIAL_SUFFIX, ".metadata")))
            formats.writing.write_durable = real
            done = formats.export_checkpoint(self.repo, "big", out, format="dcp")
        finally:
            formats.writing.write_durable, formats.export_dcp.DCP_FILE_BYTES = real, size
        self.assertEqual(done["resumed_files"], 1)
        self.assertEqual(done["files"][-1], ".metadata")
        self.assertEqual(len(done["files"]), 5)  # 3 files of tensors, the blobs' file, .metadata
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        target["note"] = None
        dcp.load(target, storage_reader=dcp.FileSystemReader(out), no_dist=True)
        for k, v in state.items():
            self.assertTrue(torch.equal(bits(target[k]), bits(v)), k)
        self.assertEqual(target["note"], b"not a pickle")


    def test_an_export_interrupted_after_its_torch_file_keeps_that_file(self):
        gen = torch.Generator().manual_seed(8)
        state = {f"layer{i}": torch.randn(32, 32, generator=gen) for i in range(3)}
        self.repo.save("small", state)
        out = os.path.join(self.tmp, "out")
        real_commit = formats.writing.Export.commit

        def dies(self_):
            raise OSError("the machine went down before the rename")

        formats.writing.Export.commit = dies
        try:
            with self.assertRaises(OSError):
                formats.export_checkpoint(self.repo, "small", out, format="torch")
        finally:
            formats.writing.Export.commit = real_commit
        self.assertFalse(os.path.exists(out))
        finished = os.stat(os.path.join(out + formats.PARTIAL_SUFFIX, "model.pt"))
        done = formats.export_checkpoint(self.repo, "small", out, format="torch")
        self.assertEqual(done["resumed_files"], 1)
        # The finished file was kept, not written again.
        kept = os.stat(os.path.join(out, "model.pt"))
        self.assertEqual((kept.st_ino, kept.st_mtime_ns), (finished.st_ino, finished.st_mtime_ns))
        got = torch.load(os.path.join(out, "model.pt"), weights_only=True)
        self.assertEqual(sorted(got), sorted(state))
        for k, v in state.items():
            self.assertTrue(torch.equal(bits(got[k]), bits(v)), k)

    def test_a_checkpoint_of_blobs_only_exports_as_torch(self):
        self.repo.save("notes", {"note": b"hello", "empty": b""})
        out = os.path.join(self.tmp, "notes")
        formats.export_checkpoint(self.repo, "notes", out, format="torch")
        # (weights_only refuses the empty bytes value's pickle.)
        self.assertEqual(torch.load(os.path.join(out, "model.pt"), weights_only=False),
                         {"empty": b"", "note": b"hello"})

    def test_a_torch_export_holds_one_tensor_in_memory_not_the_state(self):
        # 8 tensors of 32 MiB (the first two cast down from float32), read
        # by a fresh process whose peak resident memory is measured before
        # and after the export.
        state = {f"layer{i}.w": torch.full((8 << 20,), float(i)) for i in range(6)}
        state["embed"] = torch.arange(4 << 20, dtype=torch.int64)
        state["head"] = torch.arange(8 << 20, dtype=torch.int32)
        state["step"] = 12
        path = os.path.join(self.tmp, "state.pt")
        torch.save(state, path)
        self.ckpt("import", "big", path)
        # Exported first, so that what torch and the package load once is
        # not counted.
        self.repo.save("tiny", {"x": torch.ones(3)})
        # The peak resident set of the process (VmHWM: getrusage's maxrss
        # would start at this test's, which the fork copied).
        script = (
            "import sys, ckptfs, ckptfs.formats as f\n"
            "def peak():\n"
            "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
            "r = ckptfs.open(sys.argv[1])\n"
            "f.export_checkpoint(r, 'tiny', sys.argv[2] + '-tiny', format='torch', dtype=sys.argv[3] or None)\n"
            "before = peak()\n"
            "f.export_checkpoint(r, 'big', sys.argv[2], format='torch', dtype=sys.argv[3] or None)\n"
            "print((peak() - before) * 1024)\n")
        for dtype in ("", "bfloat16"):
            with self.subTest(dtype=dtype or "as stored"):
                out = os.path.join(self.tmp, f"torch-{dtype or 'stored'}")
                p = subprocess.run([sys.executable, "-c", script, self.path, out, dtype], check=True,
                                   stdout=subprocess.PIPE, env=dict(os.environ))
                grew = int(p.stdout.decode().split()[-1])
                self.assertLess(grew, 3 * (32 << 20), f"the export grew its memory by {grew >> 20} MiB")
                back = torch.load(os.path.join(out, "model.pt"), weights_only=True)
                self.assertEqual(list(back), list(state))
                self.assertEqual(back["step"], 12)
                for k in ("embed", "head"):
                    self.assertTrue(torch.equal(back[k], state[k]), k)
                for i in range(6):
                    want = state[f"layer{i}.w"].to(torch.bfloat16) if dtype else state[f"layer{i}.w"]
                    self.assertTrue(torch.equal(bits(back[f"layer{i}.w"]), bits(want)), i)


class RepositoryInTmp(unittest.TestCase):
    """A repository (64 KiB chunks) in a temporary directory of its own."""

    def setUp(self):
        import tempfile  # noqa: PLC0415

        self.tmp = tempfile.mkdtemp(prefix="ckptfs-formats-")
        self.repo = ckptfs.init(os.path.join(self.tmp, "repo"), chunk_size=64 << 10)

    def tearDown(self):
        import shutil  # noqa: PLC0415

        shutil.rmtree(self.tmp, ignore_errors=True)


class TorchSaveFiles(RepositoryInTmp):

    def test_a_nested_state_dict_imports_with_its_shape_and_values(self):
        gen = torch.Generator().manual_seed(3)
        state = {"model": {"w": torch.randn(300, 200, generator=gen), "b": torch.randn(200).to(torch.bfloat16)},
                 "optimizer": {"state": {0: {"exp_avg": torch.randn(300, 200, generator=gen)}},
                               "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]},
                 "epoch": 3}
        path = os.path.join(self.tmp, "state.pt")
        torch.save(state, path)
        self.assertEqual(formats.detect(path), "torch")
        dry = formats.import_checkpoint(self.repo, "t", path, dry_run=True)
        self.assertEqual(sorted(t["name"] for t in dry["tensors"]), ["model.b", "model.w", "optimizer.state.0.exp_avg"])
        self.assertEqual(self.repo.checkpoints(), [])
        formats.import_checkpoint(self.repo, "t", path, step=3)
        self.assertTrue(torch.equal(self.repo.tensor("t", "model.w"), state["model"]["w"]))
        self.assertTrue(torch.equal(bits(self.repo.tensor("t", "model.b")), bits(state["model"]["b"])))
        structure = json.loads(self.repo.blob("t", formats.STRUCTURE_BLOB))
        self.assertEqual([k for k, _ in structure["dict"]], ["model", "optimizer", "epoch"])
        groups = torch.load(__import__("io").BytesIO(self.repo.blob("t", "optimizer.param_groups")), weights_only=True)
        self.assertEqual(groups, state["optimizer"]["param_groups"])

    def test_a_training_checkpoint_round_trips_and_its_optimizer_steps_on_alike(self):
        # What training loops save: an optimizer's state keyed by parameter
        # index, param_groups (lists, tuples), a scheduler, tensors in lists.
        torch.manual_seed(4)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.StepLR(opt, 2)
        for _ in range(3):
            model(torch.randn(4, 16)).pow(2).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "rng": [torch.get_rng_state()], "step": 3}
        path = os.path.join(self.tmp, "train.pt")
        torch.save(state, path)
        formats.import_checkpoint(self.repo, "t", path)
        names = {t["name"] for t in self.repo.show("t")["tensors"]}
        self.assertIn("optimizer.state.0.exp_avg", names)
        self.assertIn("rng.0", names)
        out = os.path.join(self.tmp, "out")
        formats.export_checkpoint(self.repo, "t", out, format="torch")
        back = torch.load(os.path.join(out, "model.pt"), weights_only=True)
        self.assertTrue(same(state, back))
        self.assertEqual(list(back["optimizer"]["state"]), [0, 1, 2, 3])
        # The optimizer restored from the export steps on as the original.
        twin = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        twin.load_state_dict(back["model"])
        twin_opt = torch.optim.AdamW(twin.parameters())
        twin_opt.load_state_dict(back["optimizer"])
        x = torch.randn(4, 16)
        for m, o in ((model, opt), (twin, twin_opt)):
            m(x).pow(2).sum().backward()
            o.step()
        for a, b in zip(model.parameters(), twin.parameters()):
            self.assertTrue(torch.equal(a, b))

    def test_a_dict_key_neither_str_nor_int_is_refused_naming_it(self):
        path = os.path.join(self.tmp, "keys.pt")
        torch.save({"w": {1.5: torch.zeros(2)}}, path)
        with self.assertRaisesRegex(ckptfs.InvalidArgumentError, "key 1.5 under 'w' is a float"):
            formats.import_checkpoint(self.repo, "k", path)
        torch.save({"w": {0: torch.zeros(2), "0": torch.ones(2)}}, path)
        with self.assertRaisesRegex(ckptfs.InvalidArgumentError, "two entries flatten to the name 'w.0'"):
            formats.import_checkpoint(self.repo, "k", path)
        self.assertEqual(self.repo.checkpoints(include_pending=True), [])

    @unittest.skipIf(LIGHTNING_REASON, LIGHTNING_REASON or "")
    def test_a_lightning_checkpoint_imports_and_its_export_resumes_training(self):
        from test_lightning import TinyModule, data  # noqa: PLC0415

        def trainer(steps, root):
            return L.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, accelerator="cpu", default_root_dir=root)

        torch.manual_seed(0)
        t = trainer(3, self.tmp)
        t.fit(TinyModule(), data())
        ckpt = os.path.join(self.tmp, "run.ckpt")
        t.save_checkpoint(ckpt)
        run_ckpt(self, os.path.join(self.tmp, "repo"), "import", "l", ckpt)
        names = {x["name"] for x in self.repo.show("l")["tensors"]}
        self.assertIn("state_dict.layer.weight", names)
        self.assertIn("optimizer_states.0.state.0.exp_avg", names)
        out = os.path.join(self.tmp, "out")
        run_ckpt(self, os.path.join(self.tmp, "repo"), "export", "l", out, "--format", "torch")
        resumed = {}
        for label, path in (("original", ckpt), ("exported", os.path.join(out, "model.pt"))):
            module = TinyModule()
            t = trainer(6, self.tmp)
            t.fit(module, data(), ckpt_path=path)
            self.assertEqual(t.global_step, 6)
            resumed[label] = module.state_dict()
        for k, v in resumed["original"].items():
            self.assertTrue(torch.equal(v, resumed["exported"][k]), k)

    def test_a_pickle_weights_only_refuses_is_refused_with_one_line(self):
        path = os.path.join(self.tmp, "evil.pt")
        torch.save({"w": torch.zeros(2), "thing": unittest.TestCase}, path)
        with self.assertRaises(ckptfs.CorruptionError) as e:
            formats.import_checkpoint(self.repo, "evil", path)
        self.assertIn("weights_only", str(e.exception))
        self.assertEqual(len(str(e.exception).splitlines()), 1)
        self.assertEqual(self.repo.checkpoints(include_pending=True), [])

    def test_a_python_without_the_package_gets_one_line_saying_what_to_install(self):
        path = os.path.join(self.tmp, "state.pt")
        torch.save({"w": torch.zeros(2)}, path)
        bare = os.path.join(self.tmp, "bare-python")
        with open(bare, "w") as f:  # a Python that finds no ckptfs
            f.write("#!/bin/sh\nexec /usr/bin/python3 -I \"$@\"\n")  # Debian's, without ckptfs
        os.chmod(bare, 0o755)
        env = dict(os.environ, CKPT_REPO=os.path.join(self.tmp, "repo"), CKPT_PYTHON=bare)
        env.pop("PYTHONPATH", None)  # which the CLI's isolated Python would honour
        p = subprocess.run([CKPT, "import", "t", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                           timeout=120)
        err = p.stderr.decode().strip()
        self.assertEqual(p.returncode, 1, err)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("cannot import ckptfs", err)
        self.assertIn("pip install 'ckptfs[torch]'", err)
        self.assertEqual(self.repo.checkpoints(include_pending=True), [])

    def test_the_package_without_torch_says_which_extra_to_install(self):
        # A legacy (not zip) torch.save file is read by torch.load only; an
        # archive of plain tensors needs no torch.
        legacy = os.path.join(self.tmp, "legacy.pt")
        torch.save({"w": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
        archive = os.path.join(self.tmp, "state.pt")
        torch.save({"w": torch.arange(4.0)}, archive)
        # The same Python, with torch made unimportable (None in sys.modules).
        code = ("import sys; sys.modules['torch'] = None\n"
                "import ckptfs, ckptfs.formats as f\n"
                "try:\n"
                "    f.import_checkpoint(ckptfs.open(sys.argv[1]), sys.argv[3], sys.argv[2])\n"
                "except ckptfs.UnsupportedError as e:\n"
                "    print(e); sys.exit(3)\n")
        repo = os.path.join(self.tmp, "repo")
        p = subprocess.run([sys.executable, "-c", code, repo, legacy, "legacy"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
        self.assertEqual(p.returncode, 3, p.stderr.decode())
        self.assertIn("pip install 'ckptfs[torch]'", p.stdout.decode())
        self.assertEqual(self.repo.checkpoints(include_pending=True), [])
        p = subprocess.run([sys.executable, "-c", code, repo, archive, "archive"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        self.assertTrue(torch.equal(self.repo.tensor("archive", "w"), torch.arange(4.0)))


class TorchArchiveReader(RepositoryInTmp):
    """torch.save archives read without torch.load (formats.torch_zip): the
    same checkpoint as through torch.load, and damage refused."""

    def test_every_dtype_and_layout_imports_as_through_torch_load(self):
        from unittest import mock  # noqa: PLC0415

        from ckptfs.formats import torch_zip  # noqa: PLC0415

        gen = torch.Generator().manual_seed(8)
        base = torch.randn(6, 10, generator=gen)
        tied = torch.randn(5, generator=gen)
        state = collections.OrderedDict()
        for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                   torch.int16, torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64,
                   torch.float8_e4m3fn, torch.float8_e5m2):
            state[f"dtype.{str(dt).split('.')[1]}"] = (base * 3).to(dt)
        state["layout"] = {"transposed": base.t(), "row": base[2], "column": base[:, 3], "every_other": base[::2, 1::3],
                           "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "param": torch.nn.Parameter(tied),
                           "tied_a": tied, "tied_b": tied}
        state["optimizer"] = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": base[1:3]}},
                              "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]}
        state["epoch"] = 7
        path = os.path.join(self.tmp, "state.pt")
        torch.save(state, path)
        with mock.patch.object(torch, "load", side_effect=AssertionError("torch.load was called")):
            formats.import_checkpoint(self.repo, "reader", path)
        with mock.patch.object(torch_zip, "load", side_effect=torch_zip.Fallback("test")):
            formats.import_checkpoint(self.repo, "torch", path)
        a, b = self.repo.show("reader"), self.repo.show("torch")
        self.assertEqual(a["tensors"], b["tensors"])
        self.assertEqual(len(a["tensors"]), 15 + 9 + 2)
        def raw(t):
            return t.reshape(-1).view(torch.uint8)

        for t in a["tensors"]:
            self.assertTrue(torch.equal(raw(self.repo.tensor("reader", t["name"])),
                                        raw(self.repo.tensor("torch", t["name"]))), t["name"])
        self.assertTrue(torch.equal(self.repo.tensor("reader", "layout.every_other"), base[::2, 1::3]))
        self.assertEqual(a["blobs"], b["blobs"])
        for blob in (x["name"] for x in a["blobs"]):
            self.assertEqual(self.repo.blob("reader", blob), self.repo.blob("torch", blob), blob)
        out = os.path.join(self.tmp, "out")
        formats.export_checkpoint(self.repo, "reader", out, format="torch")
        self.assertTrue(same(torch.load(path, weights_only=True), torch.load(os.path.join(out, "model.pt"),
                                                                             weights_only=True)))

    def test_what_the_reader_does_not_admit_is_read_by_torch_load_alike(self):
        # torch.Size and a tensor inside a set are not in the reader's set
        # of globals and places: torch.load(weights_only=True) reads them.
        path = os.path.join(self.tmp, "other.pt")
        torch.save({"w": torch.ones(3), "shape": torch.Size([2, 3]), "held": {torch.ones(1).sum().item()}}, path)
        from ckptfs.formats import torch_zip  # noqa: PLC0415

        with self.assertRaises(torch_zip.Fallback):
            torch_zip.load(path)
        formats.import_checkpoint(self.repo, "t", path)
        self.assertTrue(torch.equal(self.repo.tensor("t", "w"), torch.ones(3)))
        shape = torch.load(__import__("io").BytesIO(self.repo.blob("t", "shape")), weights_only=True)
        self.assertEqual(shape, torch.Size([2, 3]))

    def rewritten(self, state, edit):
        """A torch.save archive of `state` whose records edit(name, bytes)
        rewrites (None drops the record)."""
        import zipfile  # noqa: PLC0415

        src = os.path.join(self.tmp, "src.pt")
        torch.save(state, src)
        path = os.path.join(self.tmp, "damaged.pt")
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                data = edit(info.filename, zin.read(info))
                if data is not None:
                    zout.writestr(info.filename, data)
        return path

    def test_a_damaged_archive_is_refused_naming_the_file_and_storing_nothing(self):
        state = {"a": torch.arange(6.0), "b": torch.arange(4.0)}
        cut = self.rewritten(state, lambda n, d: d[:8] if n.endswith("/data/0") else d)
        with self.assertRaisesRegex(ckptfs.CorruptionError, "damaged.pt: a tensor reaches past the end of storage '0' "
                                    r"\(24 bytes of 8\)"):
            formats.import_checkpoint(self.repo, "t", cut)
        missing = self.rewritten(state, lambda n, d: None if n.endswith("/data/1") else d)
        with self.assertRaisesRegex(ckptfs.CorruptionError, "names storage '1', which the archive lacks"):
            formats.import_checkpoint(self.repo, "t", missing)
        garbled = self.rewritten(state, lambda n, d: d[:40] if n.endswith("/data.pkl") else d)
        with self.assertRaisesRegex(ckptfs.CorruptionError, "data.pkl cannot be read"):
            formats.import_checkpoint(self.repo, "t", garbled)
        self.assertEqual(self.repo.checkpoints(include_pending=True), [])


if __name__ == "__main__":
    unittest.main()
