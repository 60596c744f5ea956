"""Two tiers (ckptfs.open(URL, fast_tier=...)): saves commit to a host's
fast tier and drain to the shared tier in the background; loads read each
chunk from the nearest tier that holds it intact; the fast tier keeps the
newest checkpoints and never drops one that is not durable. One process
against a local shared tier, and 4 hosts (each a process with its own fast
tier and cache directory) on the test S3 store."""
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
from helpers import CKPT, CkptTestCase  # noqa: E402
from test_python import run_ranks  # noqa: E402
from test_python_device import free_port  # noqa: E402
import tier_worker  # noqa: E402

WORKER = os.path.join(HERE, "tier_worker.py")


def flip_bytes_in_packs(fast):
    """Damages every pack of a fast tier in its middle (its chunks' bytes,
    not the index at its end)."""
    packs = glob.glob(os.path.join(fast, "objects", "packs", "**", "*.pack"), recursive=True)
    for pack in packs:
        size = os.path.getsize(pack)
        with open(pack, "r+b") as f:
            for at in range(4096, size // 2, 16 << 10):
                f.seek(at)
                f.write(b"\x5a")
    return len(packs)


def mount_small_tmpfs(test, path, size):
    """Mounts a tmpfs of `size` at `path` for a full fast tier (skips the
    test where that is not allowed)."""
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                                 stderr=subprocess.PIPE)
    except OSError as e:
        test.skipTest(f"cannot mount a small tmpfs for a full fast tier: {e}")
    if mounted.returncode != 0:
        test.skipTest(f"cannot mount a small tmpfs for a full fast tier: {mounted.stderr.decode().strip()}")
    test.addCleanup(subprocess.run, ["umount", "-l", path])


class OneHost(CkptTestCase):
    def setUp(self):
        super().setUp()
        self.shared = self.path("shared")
        self.fast = self.path("fast")
        ckptfs.init(self.shared, chunk_size=64 << 10, pack_size=1 << 20)

    def state(self, step):
        gen = torch.Generator().manual_seed(step)
        return {"frozen": torch.ones(256, 256), "w": torch.randn(256, 256, generator=gen), "rng": b"rng %d" % step}

    def test_saves_drain_in_the_background_and_loads_read_the_fast_tier(self):
        phases = []
        tiers = ckptfs.open(self.shared, fast_tier=self.fast, on_drain_phase=phases.append)
        self.assertIsInstance(tiers, ckptfs.TieredRepository)
        with open(os.path.join(self.fast, "shared-tier")) as f:
            self.assertEqual(f.read().strip(), os.path.abspath(self.shared))
        result = tiers.save("step-1", self.state(1), step=1)
        handle = result["tiers"]
        self.assertIn(handle.stage, ("local", "drained", "durable"))
        self.assertEqual(handle.wait("durable", timeout=60), "durable")
        self.assertTrue(any(p.startswith("draining step-1") for p in phases), phases)
        # async: "saving" until the fast tier's commit, then on to durable
        h = tiers.async_save("step-2", self.state(2), step=2)
        self.assertEqual(h.tiers.wait("local", timeout=60), h.tiers.stage)
        h.result()
        self.assertEqual(h.tiers.wait("durable", timeout=60), "durable")
        # the shared tier alone holds them, whole
        shared = ckptfs.open(self.shared)
        self.assertEqual([c["name"] for c in shared.checkpoints()], ["step-1", "step-2"])
        self.assertTrue(torch.equal(shared.tensor("step-2", "w"), self.state(2)["w"]))
        self.assertEqual(shared.blob("step-2", "rng"), b"rng 2")
        # a load reads the fast tier only
        out = {"frozen": torch.empty(256, 256), "w": torch.empty(256, 256)}
        before = tiers.store_counters()
        tiers.load("step-2", out)
        after = tiers.store_counters()
        self.assertTrue(torch.equal(out["w"], self.state(2)["w"]))
        self.assertEqual(after["shared"]["chunks_fetched"], before["shared"]["chunks_fetched"])
        self.assertGreater(after["fast"]["chunks_fetched"], before["fast"]["chunks_fetched"])
        self.assertEqual([(c["name"], c["tier"], c["tier_state"]) for c in tiers.checkpoints()],
                         [("step-1", "shared", "durable"), ("step-2", "shared", "durable")])
        self.assertEqual(tiers.resume_point()["name"], "step-2")
        tiers.close()

    def test_a_save_over_a_name_drains_in_place_of_the_shared_tiers_version(self):
        # "last", saved again every few steps: the newer version must reach
        # the shared tier, and never be dropped from the fast tier as if the
        # older one there were it
        tiers = ckptfs.open(self.shared, fast_tier=self.fast, keep_last=1)
        tiers.save("last", self.state(1), step=1)["tiers"].wait("durable", timeout=60)
        handle = tiers.save("last", self.state(2), step=2, overwrite=True)["tiers"]
        self.assertNotEqual(handle.stage, "durable")  # the older version's stage is not this one's
        self.assertEqual(handle.wait("durable", timeout=60), "durable")
        tiers.save("step-3", self.state(3), step=3)["tiers"].wait("durable", timeout=60)
        tiers.drain()
        self.assertEqual([e["name"] for e in tiers.status()], ["step-3"])  # "last" was trimmed
        got = {k: torch.empty_like(v) for k, v in self.state(2).items() if k != "rng"}
        tiers.shared.load("last", got)
        for k, v in got.items():
            self.assertTrue(torch.equal(v, self.state(2)[k]), k)
        tiers.close()

    def test_dcp_saves_and_loads_through_the_tiers(self):
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        from ckptfs.torch import StorageReader, StorageWriter  # noqa: PLC0415

        state = {"model": {"w": torch.randn(256, 256), "b": torch.zeros(256)}}
        writer = StorageWriter(self.shared, fast_tier=self.fast)
        dcp.save(state, storage_writer=writer, checkpoint_id="step-7")
        self.assertEqual(writer.tiers.wait("durable", timeout=60), "durable")
        self.assertEqual([c["name"] for c in ckptfs.open(self.shared).checkpoints()], ["step-7"])
        out = {"model": {"w": torch.empty(256, 256), "b": torch.ones(256)}}
        reader = StorageReader(self.shared, fast_tier=self.fast)
        dcp.load(out, storage_reader=reader, checkpoint_id="step-7")
        self.assertTrue(torch.equal(out["model"]["w"], state["model"]["w"]))
        self.assertTrue(torch.equal(out["model"]["b"], state["model"]["b"]))
        counters = reader._tiers.store_counters()
        self.assertEqual(counters["shared"]["chunks_fetched"], 0)
        self.assertGreater(counters["fast"]["chunks_fetched"], 0)
        writer._tiers.close()
        reader._tiers.close()

    def test_the_fast_tier_keeps_the_newest_and_never_drops_one_not_durable(self):
        tiers = ckptfs.open(self.shared, fast_tier=self.fast, keep_last=2)
        tiers.close(wait=False)  # no drain: saves stay local
        for step in range(1, 5):
            tiers.fast.save(f"step-{step}", self.state(step), step=step)
        self.assertEqual({c["tier_state"] for c in tiers.status()}, {"local"})
        # neither the fast tier's trim nor a gc run on it drops one
        self.assertEqual(tiers.fast._repo.plan_fast_trim(tiers.shared._repo, 1), [])
        p = subprocess.run([CKPT, "-r", self.fast, "gc", "--keep-last", "1", "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        self.assertEqual(json.loads(p.stdout)["removed"], [])
        self.assertEqual(tiers.fast.gc(keep_last=1)["removed"], [])  # from Python too
        self.assertEqual(len(tiers.fast.checkpoints()), 4)
        # resumed against the shared tier: everything drains, then the fast
        # tier keeps the newest two
        resumed = ckptfs.open(self.shared, fast_tier=self.fast, keep_last=2)
        resumed.drain(timeout=60)
        resumed.drain(timeout=60)
        self.assertEqual([c["name"] for c in resumed.fast.checkpoints()], ["step-3", "step-4"])
        self.assertEqual([c["name"] for c in ckptfs.open(self.shared).checkpoints()],
                         ["step-1", "step-2", "step-3", "step-4"])
        # an older one loads from the shared tier alone
        out = {"w": torch.empty(256, 256)}
        resumed.load("step-1", out)
        self.assertTrue(torch.equal(out["w"], self.state(1)["w"]))
        resumed.close()

    def test_a_corrupt_fast_tier_is_read_around_and_a_lost_one_too(self):
        tiers = ckptfs.open(self.shared, fast_tier=self.fast)
        tiers.save("step-1", self.state(1), step=1)["tiers"].wait("durable", timeout=60)
        tiers.close()
        self.assertGreater(flip_bytes_in_packs(self.fast), 0)
        tiers = ckptfs.open(self.shared, fast_tier=self.fast)
        out = {"w": torch.empty(256, 256), "frozen": torch.empty(256, 256)}
        tiers.load("step-1", out)
        self.assertTrue(torch.equal(out["w"], self.state(1)["w"]))
        self.assertGreater(tiers.store_counters()["shared"]["chunks_fetched"], 0)
        tiers.close()
        shutil.rmtree(self.fast)  # a replaced host
        tiers = ckptfs.open(self.shared, fast_tier=self.fast)
        self.assertEqual(tiers.resume_point()["name"], "step-1")
        tiers.load("step-1", out)
        self.assertTrue(torch.equal(out["w"], self.state(1)["w"]))
        tiers.close()

    def test_tiers_of_other_chunk_sizes_or_a_remote_fast_tier_are_refused(self):
        other = self.path("other-fast")
        ckptfs.init(other, chunk_size=128 << 10)
        with self.assertRaisesRegex(ckptfs.InvalidArgumentError, "chunks of"):
            ckptfs.open(self.shared, fast_tier=other)
        with self.assertRaisesRegex(ckptfs.InvalidArgumentError, "local directory"):
            ckptfs.open(self.shared, fast_tier="s3://bucket/x")
        tiers = ckptfs.open(self.shared, fast_tier=self.fast)
        with self.assertRaises(ckptfs.InvalidArgumentError):
            tiers.save("s", self.state(1))["tiers"].wait("sideways")
        tiers.close()
        ckptfs.init(self.path("another-shared"), chunk_size=64 << 10)
        with self.assertRaisesRegex(ckptfs.InvalidArgumentError, "drains to"):
            ckptfs.open(self.path("another-shared"), fast_tier=self.fast)

    def test_a_full_fast_tier_fails_the_save_clearly_and_loses_nothing(self):
        os.makedirs(self.fast)
        mount_small_tmpfs(self, self.fast, "6m")
        tiers = ckptfs.open(self.shared, fast_tier=self.fast, keep_last=1)
        tiers.full_wait = 5
        gen = torch.Generator().manual_seed(3)
        big = lambda: {"w": torch.randn(1024, 1024, generator=gen)}  # 4 MiB, incompressible  # noqa: E731
        first = big()
        tiers.save("step-1", first, step=1)["tiers"].wait("durable", timeout=60)
        second = big()
        # It fits once the first is durable and dropped from the fast tier:
        # the save waits for that.
        tiers.save("step-2", second, step=2)["tiers"].wait("durable", timeout=60)
        with self.assertRaisesRegex(ckptfs.StorageError, "fast tier .* is full"):
            tiers.save("step-3", {"w": torch.randn(2048, 1024, generator=gen)}, step=3)  # 8 MiB: never fits
        tiers.close()
        shared = ckptfs.open(self.shared)
        self.assertEqual([c["name"] for c in shared.checkpoints()], ["step-1", "step-2"])
        self.assertTrue(torch.equal(shared.tensor("step-1", "w"), first["w"]))
        self.assertTrue(torch.equal(shared.tensor("step-2", "w"), second["w"]))


class FourHosts(CkptTestCase):
    """4 hosts of one job, each a process with its own fast tier and cache
    directory, on the test S3 store."""

    def setUp(self):
        super().setUp()
        self.require_s3()
        self.url = f"s3://ckptfs-test/py-tiers-{os.getpid()}-{time.time_ns()}"
        # packs of two chunks: a rank's part takes several puts
        ckptfs.init(self.url, chunk_size=64 << 10, pack_size=128 << 10, cache_dir=self.path("cache-init"))
        self.hosts = self.path("hosts")

    def job(self, *args, replicas=1, strategy="ring", keep_last=2):
        port = free_port()
        env = lambda r: dict(os.environ, RANK=str(r), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",  # noqa: E731
                             MASTER_PORT=str(port), CKPT_TEST_REPLICAS=str(replicas),
                             CKPT_TEST_REPLICA_STRATEGY=strategy, CKPT_TEST_KEEP_LAST=str(keep_last))
        outs = run_ranks(self, lambda r: [sys.executable, WORKER, *args], 4, env)
        return [json.loads(o.strip().splitlines()[-1]) for o in outs]

    def visible(self):
        p = subprocess.run([CKPT, "-r", self.url, "ls", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=dict(os.environ, CKPT_CACHE_DIR=self.path("cache-look")))
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        return [c["name"] for c in json.loads(p.stdout)]

    def fast(self, rank):
        return os.path.join(self.hosts, f"host-{rank}", "fast")

    def fast_tier_ls(self, rank):
        p = subprocess.run([CKPT, "-r", self.fast(rank), "ls", "--all", "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=dict(os.environ, CKPT_CACHE_DIR=self.path(f"cache-ls-{rank}")))
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        return {c["name"]: c for c in json.loads(p.stdout)}

    def test_restores_read_the_fast_tiers_and_fall_back_to_the_shared_tier(self):
        saved = self.job("save", self.url, self.hosts, "step-1", "1")
        self.assertEqual([s["stage"] for s in saved], ["durable"] * 4)
        self.assertEqual(self.visible(), ["step-1"])
        # every fast tier intact: nothing comes from the shared tier
        loaded = self.job("resume", self.url, self.hosts, "-", "-")
        self.assertEqual({out["name"] for out in loaded}, {"step-1"})
        self.assertEqual([out["shared"]["chunks_fetched"] for out in loaded], [0] * 4, loaded)
        self.assertTrue(all(out["fast"]["chunks_fetched"] > 0 for out in loaded), loaded)
        # a host's chunks fail their hash in its fast tier: it reads them from
        # the shared tier; the others still read nothing there
        self.assertGreater(flip_bytes_in_packs(self.fast(1)), 0)
        loaded = self.job("resume", self.url, self.hosts, "-", "-")
        self.assertGreater(loaded[1]["shared"]["chunks_fetched"], 0)
        self.assertEqual([loaded[r]["shared"]["chunks_fetched"] for r in (0, 2, 3)], [0] * 3, loaded)
        # a host lost its disk
        shutil.rmtree(self.fast(2))
        loaded = self.job("resume", self.url, self.hosts, "-", "-")
        self.assertGreater(loaded[2]["shared"]["chunks_fetched"], 0)
        self.assertEqual([loaded[r]["shared"]["chunks_fetched"] for r in (0, 3)], [0] * 2, loaded)
        # every fast tier lost: all of it from the shared tier
        for r in range(4):
            shutil.rmtree(self.fast(r), ignore_errors=True)
        loaded = self.job("resume", self.url, self.hosts, "-", "-")
        self.assertTrue(all(out["shared"]["chunks_fetched"] > 0 for out in loaded), loaded)

    def test_with_replicas_a_lost_host_restores_from_its_peer_and_reads_nothing_from_the_shared_tier(self):
        saved = self.job("save", self.url, self.hosts, "step-1", "1", replicas=2)
        self.assertEqual([s["stage"] for s in saved], ["durable"] * 4)
        self.assertEqual([s["replicas"]["parts_sent"] for s in saved], [1] * 4, saved)
        self.assertEqual([s["replicas"]["parts_received"] for s in saved], [1] * 4, saved)
        # host 2 loses its disk: its part comes back from host 3's copy
        shutil.rmtree(self.fast(2))
        loaded = self.job("resume", self.url, self.hosts, "-", "-", replicas=2)
        self.assertEqual([out["restored"]["parts_received"] for out in loaded], [0, 0, 1, 0], loaded)
        self.assertEqual([out["shared"]["chunks_fetched"] for out in loaded], [0] * 4, loaded)
        # host 0 loses its disk and the copy of its part on host 1 fails its
        # hash: refused (every rank hears it), and host 0 reads the shared
        # tier; so does host 1 for its own damaged chunks
        shutil.rmtree(self.fast(0))
        self.assertGreater(flip_bytes_in_packs(self.fast(1)), 0)
        loaded = self.job("resume", self.url, self.hosts, "-", "-", replicas=2)
        self.assertTrue(all("error" in out["restored"] for out in loaded), loaded)
        self.assertIn("hash", loaded[0]["restored"]["error"] + " " + loaded[1]["restored"]["error"])
        self.assertGreater(loaded[0]["shared"]["chunks_fetched"], 0)
        self.assertEqual([loaded[r]["shared"]["chunks_fetched"] for r in (2, 3)], [0, 0], loaded)

    def test_a_full_fast_tier_drops_a_durable_checkpoint_to_fit_and_loses_nothing(self):
        fast = self.fast(1)
        os.makedirs(fast)
        mount_small_tmpfs(self, fast, "64m")
        self.job("save", self.url, self.hosts, "step-1", "1", keep_last=1)
        # host 1's fast tier now holds step-1 and less room than the new
        # bytes of step-2 (its 256 KiB of "w"; "frozen" is there already),
        # but enough once step-1 is dropped
        s = os.statvfs(fast)
        used = (s.f_blocks - s.f_bfree) * s.f_frsize
        resized = subprocess.run(["mount", "-o", f"remount,size={used + (192 << 10)}", fast], stderr=subprocess.PIPE)
        self.assertEqual(resized.returncode, 0, resized.stderr.decode())
        self.assertLess(os.statvfs(fast).f_bavail * os.statvfs(fast).f_frsize, 512 << 10)
        saved = self.job("save", self.url, self.hosts, "step-2", "2", keep_last=1)
        self.assertEqual([s["stage"] for s in saved], ["durable"] * 4, saved)
        self.assertNotIn("step-1", self.fast_tier_ls(1))  # durable, dropped to make room
        self.assertEqual(self.visible(), ["step-1", "step-2"])
        verified = subprocess.run([CKPT, "-r", self.url, "verify"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=dict(os.environ, CKPT_CACHE_DIR=self.path("cache-verify")))
        self.assertEqual(verified.returncode, 0, verified.stderr.decode())
        loaded = self.job("resume", self.url, self.hosts, "-", "-", keep_last=1)
        self.assertEqual({out["name"] for out in loaded}, {"step-2"})

    def test_dcp_with_replicas_a_lost_host_restores_from_its_peer_and_reads_nothing_from_the_shared_tier(self):
        saved = self.job("dcp-save", self.url, self.hosts, "step-1", "1", replicas=2)
        self.assertEqual([s["stage"] for s in saved], ["durable"] * 4, saved)
        self.assertTrue(all(s["replicated_stage"] in ("replicated", "drained", "durable") for s in saved), saved)
        self.assertEqual([s["replicas"]["parts_received"] for s in saved], [1] * 4, saved)
        shutil.rmtree(self.fast(2))
        loaded = self.job("dcp-load", self.url, self.hosts, "step-1", "1", replicas=2)
        self.assertEqual([out["restored"]["parts_received"] for out in loaded], [0, 0, 1, 0], loaded)
        self.assertEqual([out["shared"]["chunks_fetched"] for out in loaded], [0] * 4, loaded)
        self.assertTrue(all(out["fast"]["chunks_fetched"] > 0 for out in loaded), loaded)

    def test_replicated_shows_in_each_fast_tier_and_a_clique_keeps_its_members_parts(self):
        # cliques of 2 with a jump of 1: hosts {0, 1} and {2, 3}; no drain
        # gets past its start, so the fast tiers show "replicated"
        saved = self.job("save", self.url, self.hosts, "step-1", "1", "hold-drain", replicas=2, strategy="clique")
        self.assertEqual([s["stage"] for s in saved], ["replicated"] * 4, saved)
        for r in range(4):
            entry = self.fast_tier_ls(r)["step-1"]
            self.assertEqual(entry["tier_state"], "replicated", entry)
            self.assertEqual(entry["ranks_committed"], [0, 1] if r < 2 else [2, 3], entry)
        self.assertEqual(self.visible(), [])
        # one host of each clique drains the clique's ranks: durable
        for r in (0, 3):
            p = subprocess.run([CKPT, "-r", self.fast(r), "drain", "--json"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE,
                               env=dict(os.environ, CKPT_CACHE_DIR=os.path.join(self.hosts, f"host-{r}", "cache")))
            self.assertEqual(p.returncode, 0, p.stderr.decode())
        self.assertEqual(self.visible(), ["step-1"])
        self.assertEqual(self.fast_tier_ls(1)["step-1"]["tier_state"], "durable")

    def test_a_host_killed_mid_drain_leaves_nothing_visible_and_the_next_job_finishes_it(self):
        self.job("save", self.url, self.hosts, "step-1", "1")
        port = free_port()
        env = lambda r: dict(os.environ, RANK=str(r), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",  # noqa: E731
                             MASTER_PORT=str(port))
        procs = [subprocess.Popen([sys.executable, WORKER, "save", self.url, self.hosts, "step-2", "2",
                                   "die-mid-drain"], env=env(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for r in range(4)]
        results = [p.communicate(timeout=300) for p in procs]
        self.assertEqual(procs[1].returncode, 9, results[1][1].decode())
        for r in (0, 2, 3):
            self.assertEqual(procs[r].returncode, 0, results[r][1].decode())
            self.assertEqual(json.loads(results[r][0].decode().splitlines()[-1])["stage"], "drained")
        # host 1 put some of its part in the shared tier and was killed
        # before its rank's commit: step-2 is not visible, and its rank
        # is not in the shared tier
        self.assertEqual(self.visible(), ["step-1"])
        self.assertEqual(self.fast_tier_ls(1)["step-2"]["tier_state"], "local")
        # the restarted job resumes from step-1 (complete in the shared tier)
        # and host 1's drain finishes step-2 meanwhile
        loaded = self.job("resume", self.url, self.hosts, "-", "-")
        self.assertIn(loaded[0]["name"], ("step-1", "step-2"))
        deadline = time.time() + 60
        while self.visible() != ["step-1", "step-2"] and time.time() < deadline:
            time.sleep(0.5)
        self.assertEqual(self.visible(), ["step-1", "step-2"])
        loaded = self.job("resume", self.url, self.hosts, "-", "-")
        self.assertEqual({out["name"] for out in loaded}, {"step-2"})
        self.assertEqual([out["shared"]["chunks_fetched"] for out in loaded], [0] * 4, loaded)


if __name__ == "__main__":
    unittest.main()
