// CPU pack/unpack against the naive reference in reference.cc, bit for bit.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/lattice.h"
#include "gtest/gtest.h"
#include "kernels/convert_cpu.h"
#include "kernels/pack.h"
#include "tests/kernels/reference.h"

namespace accord {
namespace {

using testing::LoadBits;
using testing::RandomBits;
using testing::RefConvert;
using testing::RefPack;

// Uneven dim0s (below, at and above W), a zero-element parameter, inner > 1.
GroupSpec MixedSpec() {
  GroupSpec spec;
  spec.group_id = "layers.0";
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {7, 3}, {1, 1}, {0, 0}, {16, 4}, {5, 1}, {9, 2}, {3, 5}, {33, 1}, {2, 8}, {12, 3}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    spec.params.push_back(
        {absl::StrCat("p", i), shapes[i].first, shapes[i].first * shapes[i].second});
  }
  return spec;
}

std::string TestDTypeName(DType d) {
  std::string s(DTypeName(d));
  for (char& c : s) {
    if (c == '_') c = 'X';
  }
  return s;
}

// Sources: for each parameter either none (zero-filled or skipped) or a
// gradient in some dtype that widens to the wire dtype (any dtype with
// narrowing).
struct Case {
  GroupSpec spec;
  Layout layout;
  std::vector<std::vector<uint8_t>> storage;
  std::vector<GradSource> sources;
};

Case MakeCase(DType wire, int world, bool narrowing, uint64_t seed) {
  Case c;
  c.spec = MixedSpec();
  std::mt19937_64 rng(seed);
  std::vector<DType> allowed;
  for (DType d : kAllDTypes) {
    if (narrowing || IsLossless(d, wire)) allowed.push_back(d);
  }
  std::vector<bool> included(c.spec.params.size());
  c.storage.resize(c.spec.params.size());
  c.sources.resize(c.spec.params.size());
  for (size_t i = 0; i < c.spec.params.size(); ++i) {
    included[i] = (i % 5) != 4;          // parameters 4 and 9 are skipped
    const bool has_grad = (i % 3) != 1;  // parameters 1, 4, 7 have no local gradient
    if (!has_grad) continue;
    const DType d = allowed[(i + seed) % allowed.size()];
    c.storage[i] = RandomBits(d, c.spec.params[i].numel, rng);
    c.sources[i] = {c.storage[i].empty() ? nullptr : c.storage[i].data(), d};
  }
  c.layout = *ComputeLayout(c.spec, world, included, wire);
  return c;
}

class PackCpuTest : public ::testing::TestWithParam<std::tuple<DType, int>> {};

TEST_P(PackCpuTest, MatchesReferenceBitForBit) {
  const auto [wire, world] = GetParam();
  for (uint64_t seed = 0; seed < 6; ++seed) {
    Case c = MakeCase(wire, world, /*narrowing=*/false, seed);
    std::vector<uint8_t> out(static_cast<size_t>(c.layout.total_bytes()), 0xCD);
    ASSERT_TRUE(PackCpu(c.spec, c.layout, c.sources, out.data()).ok());
    EXPECT_EQ(out, RefPack(c.spec, c.layout, c.sources)) << "seed " << seed;
  }
}

TEST_P(PackCpuTest, NarrowingRoundsToNearestEvenWhenAllowed) {
  const auto [wire, world] = GetParam();
  for (uint64_t seed = 0; seed < 6; ++seed) {
    Case c = MakeCase(wire, world, /*narrowing=*/true, seed);
    std::vector<uint8_t> out(static_cast<size_t>(c.layout.total_bytes()), 0xCD);
    PackOptions options;
    options.allow_narrowing = true;
    ASSERT_TRUE(PackCpu(c.spec, c.layout, c.sources, out.data(), options).ok());
    EXPECT_EQ(out, RefPack(c.spec, c.layout, c.sources)) << "seed " << seed;
  }
}

TEST_P(PackCpuTest, UnpackPaddedChunkAndDroppedPaddingMatchReference) {
  const auto [wire, world] = GetParam();
  Case c = MakeCase(wire, world, false, 3);
  std::vector<uint8_t> packed(static_cast<size_t>(c.layout.total_bytes()));
  ASSERT_TRUE(PackCpu(c.spec, c.layout, c.sources, packed.data()).ok());
  const size_t wsize = DTypeSize(wire);
  for (DType to : kAllDTypes) {
    for (bool drop : {false, true}) {
      for (int r = 0; r < world; ++r) {
        const void* shard = packed.data() + r * c.layout.row_numel * wsize;
        std::vector<std::vector<uint8_t>> bufs(c.spec.params.size());
        std::vector<UnpackTarget> targets(c.spec.params.size());
        for (size_t i = 0; i < c.spec.params.size(); ++i) {
          if (!c.layout.params[i].included) continue;
          bufs[i].assign((c.layout.params[i].chunk_numel + 1) * DTypeSize(to), 0xEE);
          targets[i] = {bufs[i].data(), to};
        }
        UnpackOptions options;
        options.drop_padding = drop;
        ASSERT_TRUE(UnpackCpu(c.spec, c.layout, r, shard, targets, options).ok());
        for (size_t i = 0; i < c.spec.params.size(); ++i) {
          if (!c.layout.params[i].included) continue;
          const int64_t n = UnpackedNumel(c.spec, c.layout, i, r, drop);
          const int64_t valid =
              std::clamp<int64_t>(c.spec.params[i].numel - r * c.layout.params[i].chunk_numel, 0,
                                  c.layout.params[i].chunk_numel);
          EXPECT_EQ(n, drop ? valid : c.layout.params[i].chunk_numel);
          for (int64_t j = 0; j < n; ++j) {
            const uint64_t want =
                RefConvert(wire, to, LoadBits(wire, shard, c.layout.params[i].row_offset + j));
            ASSERT_EQ(LoadBits(to, bufs[i].data(), j), want)
                << "rank " << r << " param " << i << " element " << j << " to " << DTypeName(to);
          }
          // Nothing past the unpacked elements is touched.
          for (size_t k = n * DTypeSize(to); k < bufs[i].size(); ++k) ASSERT_EQ(bufs[i][k], 0xEE);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllWireDTypesAndWorlds, PackCpuTest,
                         ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                                            ::testing::Values(1, 2, 3, 8)),
                         [](const ::testing::TestParamInfo<PackCpuTest::ParamType>& info) {
                           return absl::StrCat(TestDTypeName(std::get<0>(info.param)), "_W",
                                               std::get<1>(info.param));
                         });

// Every pattern of the 8- and 16-bit dtypes, random and special fp32/fp64
// patterns, through every conversion the kernels use (fast paths included).
TEST(ConvertRunTest, EveryPairMatchesReferenceOnEveryOrRandomPattern) {
  std::mt19937_64 rng(7);
  for (DType from : kAllDTypes) {
    std::vector<uint8_t> src;
    int64_t n = 0;
    if (DTypeSize(from) <= 2) {
      n = int64_t{1} << (8 * DTypeSize(from));
      src.resize(n * DTypeSize(from));
      for (int64_t k = 0; k < n; ++k) testing::StoreBits(from, src.data(), k, k);
    } else {
      n = 200003;
      src = RandomBits(from, n, rng);
    }
    for (DType to : kAllDTypes) {
      std::vector<uint8_t> dst(n * DTypeSize(to));
      kernels::ConvertRun(from, to, src.data(), dst.data(), n);
      for (int64_t k = 0; k < n; ++k) {
        const uint64_t in = LoadBits(from, src.data(), k);
        ASSERT_EQ(LoadBits(to, dst.data(), k), RefConvert(from, to, in))
            << DTypeName(from) << " -> " << DTypeName(to) << " input bits 0x" << std::hex << in;
      }
    }
  }
}

// Every pattern of the 8- and 16-bit dtypes (NaNs, infs, -0, subnormals),
// random fp32/fp64 patterns otherwise.
std::vector<uint8_t> AllOrRandomPatterns(DType d, int64_t* n, std::mt19937_64& rng) {
  if (DTypeSize(d) <= 2) {
    *n = int64_t{1} << (8 * DTypeSize(d));
    std::vector<uint8_t> src(*n * DTypeSize(d));
    for (int64_t k = 0; k < *n; ++k) testing::StoreBits(d, src.data(), k, k);
    return src;
  }
  *n = 20011;
  return RandomBits(d, *n, rng);
}

// The streaming kernels peel a head up to a 16- or 32-byte boundary and
// convert a tail: every destination offset within 32 bytes, source offsets,
// and lengths around the vector widths, with guard bytes on both sides.
TEST(ConvertRunStreamingTest, EveryPairMatchesTheReferenceAtEveryOffsetAndLength) {
  std::mt19937_64 rng(11);
  const int64_t lengths[] = {0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 130, -1};
  for (DType from : kAllDTypes) {
    int64_t all = 0;
    const std::vector<uint8_t> src = AllOrRandomPatterns(from, &all, rng);
    for (DType to : kAllDTypes) {
      const int64_t to_size = static_cast<int64_t>(DTypeSize(to));
      for (int64_t dst_off = 0; dst_off * to_size < 32; ++dst_off) {
        for (int64_t src_off = 0; src_off < 4; ++src_off) {
          for (int64_t len : lengths) {
            const int64_t n = len < 0 ? all - src_off : len;
            if (src_off + n > all || (len < 0 && src_off > 0 && dst_off > 1)) continue;
            const uint8_t* in = src.data() + src_off * DTypeSize(from);
            // 64-byte aligned storage, so that dst_off fixes the alignment.
            std::vector<uint64_t> storage(static_cast<size_t>((n + dst_off + 80) * to_size / 8 + 2),
                                          0xA5A5A5A5A5A5A5A5ull);
            uint8_t* base = reinterpret_cast<uint8_t*>(storage.data());
            base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
            uint8_t* out = base + dst_off * to_size;
            kernels::ConvertRunStreaming(from, to, in, out, n);
            kernels::StreamFence();
            for (int64_t k = 0; k < n; ++k) {
              const uint64_t bits = LoadBits(from, in, k);
              ASSERT_EQ(LoadBits(to, out, k), RefConvert(from, to, bits))
                  << DTypeName(from) << " -> " << DTypeName(to) << " dst offset " << dst_off
                  << " src offset " << src_off << " n " << n << " element " << k << " bits 0x"
                  << std::hex << bits;
            }
            for (uint8_t* p = base; p < out; ++p) ASSERT_EQ(*p, 0xA5) << "before the run";
            for (int64_t k = 0; k < 16; ++k) ASSERT_EQ(out[n * to_size + k], 0xA5) << "after";
          }
        }
      }
    }
  }
}

TEST(ZeroStreamingTest, ZeroesExactlyTheRangeAtEveryOffsetAndLength) {
  std::vector<uint8_t> buf(256 + 64);
  uint8_t* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  for (int64_t off = 0; off < 33; ++off) {
    for (int64_t len = 0; len < 150; ++len) {
      std::fill(buf.begin(), buf.end(), 0x5A);
      kernels::ZeroStreaming(base + off, len);
      kernels::StreamFence();
      for (int64_t k = 0; k < 200; ++k) {
        ASSERT_EQ(base[k], k >= off && k < off + len ? 0 : 0x5A)
            << "offset " << off << " length " << len << " byte " << k;
      }
    }
  }
}

// Streaming stores (PackOptions::streaming_min_bytes = 0) write the same bits
// as regular ones, for every wire dtype, world size and thread count, with
// an output that starts one element past a 16-byte boundary.
TEST_P(PackCpuTest, StreamingStoresMatchReferenceAtAMisalignedOutput) {
  const auto [wire, world] = GetParam();
  const size_t wsize = DTypeSize(wire);
  for (uint64_t seed = 0; seed < 3; ++seed) {
    Case c = MakeCase(wire, world, /*narrowing=*/seed == 2, seed);
    const std::vector<uint8_t> want = RefPack(c.spec, c.layout, c.sources);
    for (int threads : {1, 2}) {
      std::vector<uint64_t> storage(want.size() / 8 + 8, 0xCDCDCDCDCDCDCDCDull);
      uint8_t* out = reinterpret_cast<uint8_t*>(storage.data()) + (wsize < 16 ? wsize : 0);
      PackOptions options;
      options.streaming_min_bytes = 0;
      options.num_threads = threads;
      options.allow_narrowing = seed == 2;
      ASSERT_TRUE(PackCpu(c.spec, c.layout, c.sources, out, options).ok());
      EXPECT_EQ(std::vector<uint8_t>(out, out + want.size()), want)
          << "seed " << seed << ", " << threads << " threads";
    }
  }
}

TEST(PackCpuThreadsTest, TwoAndThreeThreadsMatchOneThread) {
  GroupSpec spec{"big", {{"a", 1001, 1001 * 300}, {"b", 77, 77 * 1000}, {"c", 4097, 4097 * 100}}};
  std::mt19937_64 rng(1);
  std::vector<std::vector<uint8_t>> storage = {RandomBits(DType::kBFloat16, 1001 * 300, rng),
                                               {},
                                               RandomBits(DType::kFloat16, 4097 * 100, rng)};
  std::vector<GradSource> sources = {{storage[0].data(), DType::kBFloat16},
                                     {nullptr, DType::kFloat32},
                                     {storage[2].data(), DType::kFloat16}};
  Layout layout = *ComputeLayout(spec, 8, {true, true, true}, DType::kFloat32);
  ASSERT_GT(layout.total_bytes(), 2 << 20);
  const std::vector<uint8_t> want = RefPack(spec, layout, sources);
  for (int threads : {1, 2, 3}) {
    for (int64_t streaming_min_bytes : {int64_t{0}, INT64_MAX}) {
      std::vector<uint8_t> out(layout.total_bytes(), 0xCD);
      PackOptions options;
      options.num_threads = threads;
      options.streaming_min_bytes = streaming_min_bytes;
      ASSERT_TRUE(PackCpu(spec, layout, sources, out.data(), options).ok());
      EXPECT_EQ(out, want) << threads << " threads, streaming from " << streaming_min_bytes;
    }
  }
}

TEST(PackCpuTest, AllParamsSkippedPacksNothing) {
  GroupSpec spec{"g", {{"a", 4, 4}}};
  Layout layout = *ComputeLayout(spec, 2, {false}, DType::kFloat32);
  EXPECT_EQ(layout.total_bytes(), 0);
  std::vector<GradSource> sources(1);
  EXPECT_TRUE(PackCpu(spec, layout, sources, nullptr).ok());
}

class PackCpuErrorTest : public ::testing::Test {
 protected:
  GroupSpec spec_{"g7", {{"w", 4, 8}, {"b", 4, 4}}};
  std::vector<float> w_ = std::vector<float>(8, 1.0f);
  std::vector<uint16_t> b_ = std::vector<uint16_t>(4, 0x3c00);
  Layout layout_ = *ComputeLayout(spec_, 2, {true, true}, DType::kBFloat16);
  std::vector<uint8_t> out_ = std::vector<uint8_t>(layout_.total_bytes() + 8);
};

TEST_F(PackCpuErrorTest, WrongSourceCountIsInvalidArgument) {
  std::vector<GradSource> sources(1);
  absl::Status s = PackCpu(spec_, layout_, sources, out_.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("1 sources for 2 parameters"), std::string::npos) << s;
}

TEST_F(PackCpuErrorTest, NullOutputIsInvalidArgument) {
  std::vector<GradSource> sources(2);
  EXPECT_EQ(PackCpu(spec_, layout_, sources, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(PackCpuErrorTest, MisalignedOutputIsInvalidArgument) {
  std::vector<GradSource> sources(2);
  EXPECT_EQ(PackCpu(spec_, layout_, sources, out_.data() + 1).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(PackCpuErrorTest, NarrowingWithoutPermissionNamesParamAndDTypes) {
  // fp32 -> bf16 wire, and fp16 -> bf16 (incomparable): both narrowing.
  std::vector<GradSource> sources = {{w_.data(), DType::kFloat32}, {nullptr, DType::kFloat32}};
  absl::Status s = PackCpu(spec_, layout_, sources, out_.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("parameter 0 \"w\""), std::string::npos) << s;
  EXPECT_NE(s.message().find("float32"), std::string::npos) << s;
  sources = {{nullptr, DType::kFloat32}, {b_.data(), DType::kFloat16}};
  s = PackCpu(spec_, layout_, sources, out_.data());
  EXPECT_NE(s.message().find("parameter 1 \"b\""), std::string::npos) << s;
  PackOptions options;
  options.allow_narrowing = true;
  EXPECT_TRUE(PackCpu(spec_, layout_, sources, out_.data(), options).ok());
}

TEST_F(PackCpuErrorTest, LayoutOfAnotherSpecIsRefused) {
  GroupSpec other = spec_;
  other.params[1].dim0 = 2;
  other.params[1].numel = 4;
  std::vector<GradSource> sources(2);
  absl::Status s = PackCpu(other, layout_, sources, out_.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("fingerprint"), std::string::npos) << s;
}

TEST_F(PackCpuErrorTest, ZeroThreadsIsInvalidArgument) {
  std::vector<GradSource> sources(2);
  PackOptions options;
  options.num_threads = 0;
  EXPECT_EQ(PackCpu(spec_, layout_, sources, out_.data(), options).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(PackCpuErrorTest, UnpackRejectsSkippedTargetBadRankAndCount) {
  Layout skip = *ComputeLayout(spec_, 2, {true, false}, DType::kFloat32);
  std::vector<float> shard(skip.row_numel), w(8), b(4);
  std::vector<UnpackTarget> targets = {{w.data(), DType::kFloat32}, {b.data(), DType::kFloat32}};
  absl::Status s = UnpackCpu(spec_, skip, 0, shard.data(), targets);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("skipped"), std::string::npos) << s;
  targets[1].data = nullptr;
  EXPECT_TRUE(UnpackCpu(spec_, skip, 1, shard.data(), targets).ok());
  EXPECT_EQ(UnpackCpu(spec_, skip, 2, shard.data(), targets).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UnpackCpu(spec_, skip, 0, shard.data(), absl::MakeSpan(targets).subspan(0, 1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UnpackCpu(spec_, skip, 0, nullptr, targets).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace accord
