// Pinned values of the stable hash and of every fingerprint and key built on
// it. These values travel on the wire (Manifest.cache_key,
// DecisionOk.layout_fingerprint) and are compared between processes built on
// different machines, so they must never change by accident: if one of these
// tests fails, the change is a WIRE CHANGE (bump the protocol version and say
// so in the release notes) rather than something to re-pin quietly.
#include <cstdint>
#include <optional>

#include "core/group.h"
#include "core/hash.h"
#include "core/manifest.h"
#include "gtest/gtest.h"

namespace accord {
namespace {

GroupSpec GoldenSpec() {
  return GroupSpec{
      "layers.0",
      {ParamSpec{"attn.qkv.weight", 3072, 3072 * 1024}, ParamSpec{"attn.qkv.bias", 3072, 3072},
       ParamSpec{"empty", 0, 0}, ParamSpec{"mlp.fc1.weight", 4096, 4096 * 1024}}};
}

TEST(GoldenTest, StableHasher) {
  StableHasher empty;
  EXPECT_EQ(empty.Finish(), 0x3564b439cd1e1f16ull);
  StableHasher h;
  h.AddU64(1);
  h.AddU64(0xdeadbeefull);
  h.AddBytes("accord");
  EXPECT_EQ(h.Finish(), 0xfbffa48bef8392c2ull);
}

TEST(GoldenTest, SpecFingerprint) {
  EXPECT_EQ(SpecFingerprint(GoldenSpec()), 0x8d2729cebcd6c8b3ull);
}

TEST(GoldenTest, LayoutFingerprint) {
  EXPECT_EQ(LayoutFingerprint(GoldenSpec(), 8, {true, false, false, true}, DType::kBFloat16),
            0xa1e47dd5118cb821ull);
  EXPECT_EQ(LayoutFingerprint(GoldenSpec(), 3, {true, true, true, true}, DType::kFloat32),
            0x0d718515c03ddf0cull);
}

TEST(GoldenTest, ManifestKey) {
  Manifest m = RankManifest(5, 2, 70, {DType::kBFloat16, std::nullopt, DType::kFloat32});
  m.ranks.Add(69);
  EXPECT_EQ(ManifestKey(m), 0x5de095e53e803786ull);
  const Manifest wide =
      RankManifest(0, 0, 1, std::vector<std::optional<DType>>(19, DType::kFloat8E5M2));
  EXPECT_EQ(ManifestKey(wide), 0xa46cbf6331343693ull);
}

}  // namespace
}  // namespace accord
