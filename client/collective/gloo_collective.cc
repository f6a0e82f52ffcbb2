#include "client/collective/gloo_collective.h"

#include <cstring>
#include <exception>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/collective/sum_reduce.h"
#include "gloo/allreduce.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/tcp/device.h"

namespace accord {

void KvGlooStore::set(const std::string& key, const std::vector<char>& data) {
  absl::Status s = kv_.Set(absl::StrCat(prefix_, "/", key), std::string(data.begin(), data.end()));
  if (!s.ok()) {
    throw gloo::IoException(
        absl::StrCat("accord gloo store: set \"", prefix_, "/", key, "\" failed: ", s.ToString()));
  }
}

std::vector<char> KvGlooStore::get(const std::string& key) {
  absl::StatusOr<std::vector<std::string>> v = kv_.Get({absl::StrCat(prefix_, "/", key)}, timeout_);
  if (!v.ok()) {
    throw gloo::IoException(absl::StrCat("accord gloo store: get \"", prefix_, "/", key,
                                         "\" failed: ", v.status().ToString()));
  }
  return std::vector<char>((*v)[0].begin(), (*v)[0].end());
}

void KvGlooStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void KvGlooStore::wait(const std::vector<std::string>& keys,
                       const std::chrono::milliseconds& timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const std::string& k : keys) full.push_back(absl::StrCat(prefix_, "/", k));
  absl::StatusOr<std::vector<std::string>> v =
      kv_.Get(full, timeout.count() > 0 ? timeout : timeout_);
  if (!v.ok()) {
    throw gloo::IoException(absl::StrCat("accord gloo store: waiting for ",
                                         absl::StrJoin(full, ", "),
                                         " failed: ", v.status().ToString()));
  }
}

absl::StatusOr<std::unique_ptr<Collective>> GlooCollective::Create(
    int rank, int world_size, KeyValueStore& kv, std::string key_prefix,
    const CollectiveOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo: rank ", rank, " is not within world size ", world_size));
  }
  gloo::transport::tcp::attr attr;
  if (!options.gloo_iface.empty()) {
    attr.iface = options.gloo_iface;
  } else {
    attr.hostname = options.gloo_hostname.empty() ? "127.0.0.1" : options.gloo_hostname;
  }
  try {
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
    context->setTimeout(options.timeout);
    KvGlooStore store(kv, key_prefix, options.timeout);
    context->connectFullMesh(store, device);
    return std::unique_ptr<Collective>(
        new GlooCollective(rank, world_size, std::move(context), options));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "gloo: rank ", rank, " of ", world_size, " could not connect the mesh under \"", key_prefix,
        "\" (iface \"", attr.iface, "\", host \"", attr.hostname, "\"): ", e.what(),
        "; check that every rank started with the same world size and key prefix and can reach "
        "the others' address"));
  }
}

absl::Status GlooCollective::CheckWireDType(DType wire) const { return GlooWireDTypeStatus(wire); }

absl::Status GlooCollective::ReduceScatterSum(const void* in, void* out, int64_t row_numel,
                                              DType wire, void* stream) {
  const int64_t op = ops_++;
  if (row_numel < 0 || (row_numel > 0 && (in == nullptr || out == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat("gloo reduce-scatter #", op, ": row_numel ",
                                                   row_numel, " with in=", in != nullptr,
                                                   " out=", out != nullptr));
  }
  if (row_numel == 0) return absl::OkStatus();
  const size_t row_bytes = static_cast<size_t>(row_numel) * DTypeSize(wire);
  if (world_size_ == 1) {
    if (out != in) std::memcpy(out, in, row_bytes);
    return absl::OkStatus();
  }
  try {
    if (options_.gloo_algorithm == GlooAlgorithm::kAllreduce) {
      Allreduce(static_cast<const char*>(in), static_cast<char*>(out), row_bytes,
                static_cast<size_t>(row_numel), wire);
    } else {
      Ring(static_cast<const char*>(in), static_cast<char*>(out), row_bytes,
           static_cast<size_t>(row_numel), wire);
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "gloo reduce-scatter #", op, " on rank ", rank_, " of ", world_size_, " (", row_numel,
        " elements of ", DTypeName(wire), " per rank) failed: ", e.what(),
        "; a peer may have exited or diverged (check every rank issues the same collectives in "
        "the same order)"));
  }
  return absl::OkStatus();
}

// Ring: at step s rank r sends its running sum of row (r-s-1) to r+1 and
// receives row (r-s-2)'s from r-1, adding its own contribution. After W-1
// steps it holds the full sum of row r. The add order per row is fixed, so
// results are deterministic.
void GlooCollective::Ring(const char* in, char* out, size_t row_bytes, size_t row_numel,
                          DType wire) {
  const int w = world_size_;
  const int left = (rank_ + w - 1) % w;
  const int right = (rank_ + 1) % w;
  auto row = [&](int c) { return in + static_cast<size_t>(((c % w) + w) % w) * row_bytes; };
  if (send_.size() < row_bytes) send_.resize(row_bytes);
  if (recv_.size() < row_bytes) recv_.resize(row_bytes);
  auto recv_buf = context_->createUnboundBuffer(recv_.data(), row_bytes);
  auto send_buf = context_->createUnboundBuffer(send_.data(), row_bytes);
  auto first_buf = context_->createUnboundBuffer(const_cast<char*>(row(rank_ - 1)), row_bytes);
  for (int s = 0; s < w - 1; ++s) {
    const uint64_t slot = static_cast<uint64_t>(context_->nextSlot());
    auto& sending = s == 0 ? first_buf : send_buf;
    recv_buf->recv(left, slot);
    sending->send(right, slot);
    if (!recv_buf->waitRecv(options_.timeout)) {
      throw gloo::IoException(absl::StrCat("receive from rank ", left, " aborted"));
    }
    if (!sending->waitSend(options_.timeout)) {
      throw gloo::IoException(absl::StrCat("send to rank ", right, " aborted"));
    }
    const bool last = s == w - 2;
    SumInto(wire, last ? out : send_.data(), recv_.data(), row(rank_ - s - 2), row_numel);
  }
}

void GlooCollective::Allreduce(const char* in, char* out, size_t row_bytes, size_t row_numel,
                               DType wire) {
  const size_t total = row_bytes * static_cast<size_t>(world_size_);
  if (send_.size() < total) send_.resize(total);
  std::memcpy(send_.data(), in, total);
  gloo::AllreduceOptions opts(context_);
  const size_t elements = row_numel * static_cast<size_t>(world_size_);
  switch (DTypeSize(wire)) {
    case 1:
      opts.setOutput(reinterpret_cast<uint8_t*>(send_.data()), elements);
      break;
    case 2:
      opts.setOutput(reinterpret_cast<uint16_t*>(send_.data()), elements);
      break;
    case 4:
      opts.setOutput(reinterpret_cast<uint32_t*>(send_.data()), elements);
      break;
    default:
      opts.setOutput(reinterpret_cast<uint64_t*>(send_.data()), elements);
      break;
  }
  opts.setReduceFunction(
      [wire](void* o, const void* a, const void* b, size_t n) { SumInto(wire, o, a, b, n); });
  opts.setTag(static_cast<uint32_t>(context_->nextSlot()));
  opts.setTimeout(options_.timeout);
  gloo::allreduce(opts);
  std::memcpy(out, send_.data() + static_cast<size_t>(rank_) * row_bytes, row_bytes);
}

}  // namespace accord
