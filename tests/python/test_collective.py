"""Collective saves and restores (process_group=): 4 processes on gloo,
against a local repository and, where an S3 endpoint is configured, the S3
store. Three layouts: HSDP (2 replica groups x 2 row shards, a norm on
every rank), pure data parallelism (everything on every rank), and mixed
(small tensors on every rank beside a large one split over all). The
engine's own counters prove the work is not repeated: the bytes the ranks
put (hash and encode) add up to the unique bytes, and the stored bytes the
ranks fetch add up to at most 1.05x the checkpoint's stored bytes. A rank
killed in the middle makes every other rank raise, and nothing shows."""
import json
import os
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
import collective_worker  # noqa: E402
from helpers import CkptTestCase  # noqa: E402
from test_python import run_ranks  # noqa: E402
from test_python_device import free_port  # noqa: E402
import zygote  # noqa: E402

try:
    import torch.distributed as dist  # noqa: E402

    REASON = None if dist.is_available() else "torch.distributed is not available"
except ImportError as e:
    REASON = f"torch is not importable: {e}"

WORKER = os.path.join(HERE, "collective_worker.py")
WORLD = 4


class Transport(unittest.TestCase):
    def test_regions_take_the_callers_nccl_group_only_when_every_rank_loads_into_its_own_gpu(self):
        over_nccl = ckptfs.collective._over_nccl
        self.assertTrue(over_nccl(["GPU-a", "GPU-b", "GPU-c"]))
        self.assertTrue(over_nccl(["GPU-a"]))
        # Two ranks on one GPU: NCCL would refuse them.
        self.assertFalse(over_nccl(["GPU-a", "GPU-b", "GPU-a"]))
        # A rank loading (some targets) into host memory.
        self.assertFalse(over_nccl(["GPU-a", None]))


@unittest.skipIf(REASON, REASON or "")
class Collective(CkptTestCase):
    def setUp(self):
        super().setUp()
        # Small chunks: the test's tensors (192 KiB a layer) span many.
        ckptfs.init(self.repo, chunk_size=64 << 10, pack_size=1 << 20)
        self.url = self.repo
        self.env = {}

    def use_s3(self):
        self.require_s3()
        self.url = f"s3://ckptfs-test/py-collective-{os.getpid()}-{time.time_ns()}"
        self.env = {"CKPT_CACHE_DIR": self.path("cache")}
        os.environ["CKPT_CACHE_DIR"] = self.env["CKPT_CACHE_DIR"]
        try:
            ckptfs.init(self.url, chunk_size=64 << 10, pack_size=1 << 20)
        finally:
            del os.environ["CKPT_CACHE_DIR"]

    def job(self, world, *args, ok=True):
        port = free_port()
        env = lambda r: dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",  # noqa: E731
                             MASTER_PORT=str(port), **self.env)
        argv = lambda r: [sys.executable, WORKER, args[0], self.url, *args[1:]]  # noqa: E731
        if ok:
            outs = run_ranks(self, argv, world, env)
            return [o.strip().splitlines()[-1] for o in outs]
        procs = [zygote.spawn(argv(r), env(r)) for r in range(world)]
        results = [p.communicate(timeout=300) for p in procs]
        return [(p.returncode, out.decode().strip()) for p, (out, _) in zip(procs, results)]

    def stored_bytes(self, name):
        env = dict(os.environ, **self.env)
        import subprocess  # noqa: PLC0415

        from helpers import CKPT  # noqa: PLC0415

        du = json.loads(subprocess.run([CKPT, "-r", self.url, "du", "--json"], env=env, check=True,
                                       stdout=subprocess.PIPE).stdout)
        [c] = [c for c in du["checkpoints"] if c["name"] == name]
        return c

    def round_trip(self, layout):
        plain = [json.loads(x) for x in self.job(WORLD, "save", f"{layout}-plain", layout, "plain")]
        saved = [json.loads(x) for x in self.job(WORLD, "save", layout, layout, "verify")]
        plan = saved[0]["plan"]
        # Every rank computed the same plan; the bytes put add up to the
        # unique bytes, whatever the replication.
        self.assertTrue(all(s["plan"] == plan for s in saved), saved)
        self.assertEqual(sum(s["logical"] for s in saved), plan["unique_bytes"])
        self.assertEqual(sum(p["logical"] for p in plain), plan["held_bytes"])
        self.assertEqual([s["logical"] for s in saved], plan["bytes_per_rank"])
        # Restored at the saved world size and at 2 ranks (another
        # replication): bit-exact (checked by the workers), and each chunk
        # fetched from the store about once across the ranks.
        stored = self.stored_bytes(layout)
        for world in (WORLD, 2):
            with self.subTest(world=world):
                got = [json.loads(x) for x in self.job(world, "load", layout, layout)]
                # Every tensor is restored, so each stored chunk once is
                # exactly the checkpoint's referenced bytes.
                self.assertEqual(sum(g["fetched"] for g in got), stored["referenced_bytes"], (got, stored))
                # Host memory travels over ckptfs's gloo group.
                self.assertEqual({tuple(g["delivered"]) for g in got}, {("ckptfs:cpu",)}, got)
        return plan

    def test_hsdp_saves_each_replica_once_and_restores_fetching_each_chunk_once(self):
        plan = self.round_trip("hsdp")
        want = collective_worker.full()
        small = sum(want[k].numel() * want[k].element_size() for k in ("norm", "bias"))
        # The layers and the embedding are held twice (2 replica groups),
        # the norm and the bias by all 4 ranks.
        self.assertEqual(plan["unique_bytes"], sum(t.numel() * t.element_size() for t in want.values()))
        self.assertEqual(plan["held_bytes"], 2 * (plan["unique_bytes"] - small) + WORLD * small)

    def test_pure_data_parallel(self):
        plan = self.round_trip("dp")
        self.assertEqual(plan["held_bytes"], WORLD * plan["unique_bytes"])

    def test_mixed_replicated_and_sharded(self):
        self.round_trip("mixed")

    def test_a_restore_whose_cuts_split_chunks_fetches_each_chunk_once(self):
        # The embedding's rows saved at 4 ranks and restored at 3: the cuts
        # (every 128000 bytes) fall inside stored chunks, which the rank that
        # fetched them hands to the other reader.
        self.job(WORLD, "save", "m", "mixed", "plain")
        got = [json.loads(x) for x in self.job(3, "load", "m", "mixed")]
        self.assertEqual(sum(g["fetched"] for g in got), self.stored_bytes("m")["referenced_bytes"], got)

    def test_async_save_plans_as_save_does(self):
        saved = [json.loads(x) for x in self.job(WORLD, "save", "a", "dp", "async")]
        want = collective_worker.full()
        self.assertEqual(sum(s["logical"] for s in saved), sum(t.numel() * t.element_size() for t in want.values()))
        got = [json.loads(x) for x in self.job(2, "load", "a", "dp")]
        self.assertLessEqual(sum(g["fetched"] for g in got), 1.05 * self.stored_bytes("a")["referenced_bytes"])

    def test_on_s3(self):
        self.use_s3()
        self.round_trip("hsdp")

    def test_a_restart_lists_the_store_once_for_the_job(self):
        self.use_s3()
        self.job(WORLD, "save", "r1", "hsdp")
        self.job(WORLD, "save", "r2", "mixed")
        # Four hosts (a catalog each) restart from the latest checkpoint:
        # each alone, then as one job. The store's LIST requests, counted
        # by each process's repository, from the open to the loaded state.
        alone = [json.loads(x) for x in self.job(WORLD, "restart", "r2", "mixed", "alone")]
        together = [json.loads(x) for x in self.job(WORLD, "restart", "r2", "mixed", "together")]
        self.assertEqual({r["name"] for r in alone + together}, {"r2"})
        one = alone[0]["lists"]
        self.assertGreater(one, 0)
        self.assertEqual([a["lists"] for a in alone], [one] * WORLD)
        # One LIST sequence for the job: rank 0's; the others list nothing.
        self.assertEqual([t["lists"] for t in together], [one] + [0] * (WORLD - 1))
        # Rank 0 sent the manifests it fetched: the others did not GET them.
        self.assertLess(sum(t["gets"] for t in together), sum(a["gets"] for a in alone))
        # One read lease for the job (a PUT), rank 0's, not one a rank.
        self.assertTrue(all(a["puts"] >= 1 for a in alone), alone)
        self.assertEqual([t["puts"] for t in together], [alone[0]["puts"]] + [0] * (WORLD - 1))

    def test_a_collective_save_lists_the_store_once_for_the_job(self):
        # Every rank saving alone takes a store lock (a listing of the
        # exclusive locks), lists the store when it begins (pending ranks,
        # manifests, packs) and looks for the other ranks at its commit.
        # With the group only rank 0 does any of it: the others apply its
        # listing, take no lock and put their parts, and rank 0's commit
        # waits for every part and completes the checkpoint. Async saves,
        # whose commits run in the background, do the same.
        self.use_s3()
        alone = [json.loads(x) for x in self.job(WORLD, "save", "alone", "hsdp", "plain")]
        together = [json.loads(x) for x in self.job(WORLD, "save", "together", "hsdp")]
        background = [json.loads(x) for x in self.job(WORLD, "save", "background", "hsdp", "async")]
        self.assertTrue(all(a["lists"] >= 5 for a in alone), alone)
        for saved in (together, background):
            self.assertEqual([t["lists"] for t in saved[1:]], [0] * (WORLD - 1), saved)
            self.assertGreater(saved[0]["lists"], 0, saved)
        self.assertLess(sum(t["lists"] for t in together), sum(a["lists"] for a in alone) / 2, (alone, together))
        # Both are whole: restored bit-exact (checked by the workers).
        for name in ("together", "background"):
            self.job(WORLD, "load", name, "hsdp")
        # A name taken: rank 0's error, as its own type, on every rank.
        out = self.job(WORLD, "save", "together", "hsdp")
        for line in out:
            self.assertTrue(line.startswith("raised: AlreadyExistsError: "), line)
        for line in out[1:]:
            self.assertIn(f"(rank 0 of {WORLD}, in 'begin and share the store listing')", line)
        # Saved again with overwrite: rank 0's attempt, shared, replaces it whole.
        self.job(WORLD, "save", "together", "hsdp", "overwrite")
        self.job(WORLD, "load", "together", "hsdp")
        listed = [c["name"] for c in ckptfs.open(self.url).checkpoints(include_pending=True)]
        self.assertEqual(listed[-1], "together")  # the newest commit now
        self.assertEqual(listed.count("together"), 1)

    def test_a_rank_failing_to_open_fails_every_rank_naming_it(self):
        out = self.job(WORLD, "open-fail", "-", "dp")
        for line in out:
            self.assertTrue(line.startswith("raised: CollectiveError:"), out)
            self.assertIn("rank 2 failed in 'open the repository'", line)
        self.assertIn("NotFoundError", out[2])

    def test_dcp_load_through_the_storage_reader_fetches_each_region_once(self):
        self.job(WORLD, "save", "d", "hsdp")
        stored = self.stored_bytes("d")["referenced_bytes"]
        together = [json.loads(x) for x in self.job(WORLD, "dcp-load", "d", "-")]
        alone = [json.loads(x) for x in self.job(WORLD, "dcp-load", "d", "-", "alone")]
        self.assertLessEqual(sum(g["fetched"] for g in together), 1.05 * stored, together)
        # Without the group, each of the 2 replica groups fetches it all.
        self.assertGreater(sum(g["fetched"] for g in alone), 1.9 * stored, alone)

    def test_dcp_load_through_the_storage_reader_takes_one_read_lease_for_the_job_on_s3(self):
        self.use_s3()
        self.job(WORLD, "save", "d", "hsdp")
        together = [json.loads(x) for x in self.job(WORLD, "dcp-load", "d", "-")]
        alone = [json.loads(x) for x in self.job(WORLD, "dcp-load", "d", "-", "alone")]
        # Alone, every rank (a host) leases the checkpoint: a PUT each.
        self.assertTrue(all(a["puts"] >= 1 for a in alone), alone)
        # With the group, rank 0's lease is the job's: the others PUT nothing.
        self.assertGreaterEqual(together[0]["puts"], 1, together)
        self.assertEqual([t["puts"] for t in together[1:]], [0] * (WORLD - 1), together)

    def test_rank_0_resolves_the_resume_point_for_every_rank(self):
        # Rank 0's error on every rank; the others say whose it was.
        missing = "NotFoundError: no committed checkpoint named 'no-such'"
        got = [json.loads(x) for x in self.job(WORLD, "resume", "-", "-")]
        self.assertEqual(got[0], {"latest": None, "step": None, "missing": missing})
        for g in got[1:]:
            self.assertEqual(g, {"latest": None, "step": None, "missing": f"{missing} (rank 0 of {WORLD}, in 'share "
                                 "the resume point')"})
        self.job(WORLD, "save", "first", "dp")
        self.job(WORLD, "save", "second", "hsdp")
        got = [json.loads(x) for x in self.job(WORLD, "resume", "-", "-")]
        self.assertEqual([g["latest"] for g in got], ["second"] * WORLD)
        self.assertEqual([g["step"] for g in got], [5] * WORLD)

    def test_replicas_that_differ_fail_on_every_rank_naming_the_tensor(self):
        outs = self.job(WORLD, "save", "bad", "hsdp", "differ")
        for line in outs:
            self.assertIn("raised: CollectiveError", line)
            self.assertIn("'norm' differ", line)
        self.assertEqual(ckptfs.open(self.repo).checkpoints(include_pending=True), [])

    def test_ranks_naming_different_checkpoints_fail_every_rank_naming_both(self):
        outs = self.job(WORLD, "save", "n", "hsdp", "other-name")
        for line in outs:
            self.assertIn("raised: CollectiveError", line)
            self.assertIn("rank 0 saves checkpoint 'n' and rank 1 saves 'n-other'", line)
        self.assertEqual(ckptfs.open(self.repo).checkpoints(include_pending=True), [])

    def test_a_bad_shard_fails_every_rank_with_its_reason(self):
        outs = self.job(WORLD, "save", "bad", "hsdp", "bad-shard")
        for line in outs:
            self.assertIn("raised: CollectiveError", line)
            # The reason, not a key cut at the NUL before its dtype.
            self.assertIn("rank 1, 'layers.0.w' (F32): box [96:144, 0:500] exceeds shape [96, 500]", line)
        self.assertEqual(ckptfs.open(self.repo).checkpoints(include_pending=True), [])

    def assert_rank_1_died_and_the_others_raised(self, got):
        """A job's (exit status, output) by rank: rank 1 exited (3), the
        others finished and raised CollectiveError."""
        self.assertEqual(got[1][0], 3)
        for r in (0, 2, 3):
            code, out = got[r]
            self.assertEqual(code, 0, out)
            self.assertIn("raised: CollectiveError", out)

    def test_a_rank_dying_mid_save_or_restore_fails_every_other_rank_and_nothing_shows(self):
        start = time.monotonic()
        got = self.job(WORLD, "die-save", "dead", "hsdp", ok=False)
        self.assert_rank_1_died_and_the_others_raised(got)
        self.assertLess(time.monotonic() - start, 120)
        self.assertEqual(ckptfs.open(self.repo).checkpoints(include_pending=True), [])
        self.job(WORLD, "save", "alive", "hsdp")
        got = self.job(WORLD, "die-load", "alive", "hsdp", ok=False)
        self.assertEqual(got[1][0], 3)
        for r in (0, 2, 3):
            self.assertIn("raised: CollectiveError", got[r][1])

    def test_regions_go_over_the_callers_group_where_every_rank_has_a_gpu_of_its_own(self):
        # The NCCL path (a batch of point-to-point operations on the job's
        # group, after one all-reduce there, polled to the timeout), with
        # the job's gloo group standing in for NCCL: restores at 4 and 2
        # ranks, bit-exact, each chunk fetched once.
        self.job(WORLD, "save", "n", "hsdp", "plain")
        stored = self.stored_bytes("n")["referenced_bytes"]
        for world in (WORLD, 2):
            with self.subTest(world=world):
                got = [json.loads(x) for x in self.job(world, "load", "n", "hsdp", "as-nccl")]
                self.assertEqual(sum(g["fetched"] for g in got), stored, got)
                self.assertEqual({tuple(g["delivered"]) for g in got}, {("caller:cpu",)}, got)
        # A rank gone as the regions go out: the others stop waiting for it
        # and raise, naming the step.
        start = time.monotonic()
        got = self.job(WORLD, "die-deliver", "n", "hsdp", "as-nccl", ok=False)
        self.assert_rank_1_died_and_the_others_raised(got)
        for r in (0, 2, 3):
            self.assertIn("deliver the fetched regions", got[r][1])
        self.assertLess(time.monotonic() - start, 120)

    def test_a_rank_whose_host_knows_another_checkpoint_of_that_name_fails_every_rank(self):
        # Only rank 0 leases the checkpoint, so every rank must have opened
        # the one it leased.
        self.job(WORLD, "save", "s", "hsdp", "plain")
        for out in self.job(WORLD, "load", "s", "hsdp", "stale"):
            self.assertIn("raised: CollectiveError", out)
            self.assertIn("rank 2's host knows another checkpoint named 's' than rank 0's", out)

    def test_a_rank_dying_before_it_commits_its_part_fails_every_other_rank_and_nothing_is_committed(self):
        # On S3 the commit is split: ranks 2 and 3 put their parts and
        # wait at the commit's agreement; rank 0's commit waits for every
        # part, gives up on rank 1's within the timeout (8 s here) and
        # says so; every live rank raises.
        self.use_s3()
        start = time.monotonic()
        got = self.job(WORLD, "die-commit", "half", "hsdp", ok=False)
        self.assert_rank_1_died_and_the_others_raised(got)
        self.assertIn("rank 1 of 4 did not commit its part", got[0][1])
        self.assertLess(time.monotonic() - start, 60)
        os.environ["CKPT_CACHE_DIR"] = self.env["CKPT_CACHE_DIR"]
        try:
            self.assertEqual(ckptfs.open(self.url).checkpoints(), [])
        finally:
            del os.environ["CKPT_CACHE_DIR"]


if __name__ == "__main__":
    unittest.main()
