// Writes damaged records into a repository, the way a bug, a bad disk or an
// attacker could, so the integration tests can check that every command
// rejects them cleanly. Records are encoded with the engine's own encoders,
// which do not validate.
//
//   craft_record manifest REPO CHECKPOINT NEW KIND   write manifests/NEW.manifest:
//                                                    CHECKPOINT's manifest, renamed
//                                                    NEW, with its first tensor damaged
//   craft_record catalog REPO CHECKPOINT KIND        damage CHECKPOINT's first tensor
//                                                    record in the LMDB catalog
// KIND: short-shard  a shard whose chunks hold fewer bytes than its region
//       box-rank     a box shard whose offsets have another rank than the tensor
//       huge-chunk   a chunk longer than any repository allows
#include <cstdio>
#include <string>

#include "ckpt/repository_impl.h"
#include "store/pack.h"

using namespace ckptfs;

namespace {

int Die(const std::string& what) {
  std::fprintf(stderr, "craft_record: %s\n", what.c_str());
  return 1;
}

// Damages `t` as `kind` says; false when `t` cannot be damaged that way.
bool Damage(TensorRecord& t, const std::string& kind) {
  if (t.shards.empty()) return false;
  ShardRecord& s = t.shards.front();
  if (kind == "short-shard") {
    if (s.chunks.size() < 2) return false;
    s.chunks.pop_back();
  } else if (kind == "box-rank") {
    Box b = FullBox(t.shape);
    b.offsets.push_back(0);  // one more offset than lengths and dimensions
    s.region = Region::OfBox(b);
  } else if (kind == "huge-chunk") {
    s.chunks.front().raw_len = kMaxChunkSize + 1;
  } else {
    return false;
  }
  s.ComputeStarts();
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) return Die("usage: see the comment at the top of craft_record.cc");
  const std::string mode = argv[1], repo = argv[2], checkpoint = argv[3];
  auto backend = OpenLocalBackend(repo + "/objects");
  if (!backend.ok()) return Die(backend.status().ToString());
  auto data = (*backend)->ReadAll(keys::ManifestObject(checkpoint));
  if (!data.ok()) return Die(data.status().ToString());
  auto manifest = DecodeManifest(*data);
  if (!manifest.ok()) return Die(manifest.status().ToString());
  Manifest m = std::move(manifest).value();
  if (m.tensors.empty()) return Die("checkpoint has no tensor");

  if (mode == "manifest" && argc == 6) {
    const std::string name = argv[4], kind = argv[5];
    if (!Damage(m.tensors.front(), kind)) return Die("cannot apply " + kind + " to tensor " + m.tensors.front().name);
    m.checkpoint.name = name;
    m.checkpoint.sequence += 1000;
    const std::string bytes = EncodeManifest(m);
    Status st = (*backend)->Put(keys::ManifestObject(name), std::as_bytes(std::span(bytes)));
    if (!st.ok()) return Die(st.ToString());
    std::printf("%s\n", m.tensors.front().name.c_str());
    return 0;
  }
  if (mode == "catalog" && argc == 5) {
    const std::string kind = argv[4];
    TensorRecord t = m.tensors.front();
    if (!Damage(t, kind)) return Die("cannot apply " + kind + " to tensor " + t.name);
    auto env = LmdbEnv::Open(repo + "/catalog", false, 0);
    if (!env.ok()) return Die(env.status().ToString());
    Status st = (*env)->Update([&](WriteTxn& txn) {
      return txn.Put(Table::kTensors, keys::Member(checkpoint, t.name), EncodeTensor(t));
    });
    if (!st.ok()) return Die(st.ToString());
    std::printf("%s\n", t.name.c_str());
    return 0;
  }
  return Die("usage: see the comment at the top of craft_record.cc");
}
