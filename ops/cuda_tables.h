// Device copies of the layout ops' segment tables, kept and reused: a table is uploaded once per layout and stream.
//
// Training calls most layout ops with the same tensors step after step (the package's buffers are fixed, a
// parameter's storage does not move), so the table the host builds, pointers included, repeats byte for byte. A
// table is uploaded through pinned memory on the current stream for its call; the second time the same bytes come
// on the same stream, the upload is kept, and later calls launch on the kept copy with no copy at all. Tables that
// never repeat (gradients the autograd allocator places anew each step) are never kept, so they do not grow the
// device memory after warm-up. The key holds every byte of the table, pointers included, so a hit describes
// exactly the memory the call names, whatever tensor now lives there.
//
// Why the stream is part of the key: a kept table is allocated (by the caching allocator) on the stream that
// uploaded it and read only by kernels on that stream, so freeing it on eviction is ordered after its last reader
// without any event. Several communication threads call the ops, each on its own stream: one lock guards the map.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace dsa {

class DeviceTables {
public:
    // Tables kept at most, and the most bytes of one kept table; a larger one is uploaded for its call alone.
    // Hashes of tables seen once, at most (then forgotten all at once).
    static const size_t kMaxTables = 1024;
    static const size_t kMaxTableBytes = 64 * 1024;
    static const size_t kMaxSeen = 8192;

    // The device address of the table `entries` for a kernel on `stream`. `scratch` receives the uploaded tensor
    // when the table is not kept; the caller holds it until the launch is enqueued (the caching allocator then
    // orders its reuse after the kernel, on the same stream).
    template <class Entry>
    const void* get(const std::vector<Entry>& entries, const c10::cuda::CUDAStream& stream, at::Tensor& scratch) {
        const size_t bytes = entries.size() * sizeof(Entry);
        if (bytes > kMaxTableBytes) {
            scratch = upload(entries.data(), bytes, stream.device());
            return scratch.data_ptr();
        }
        const StreamKey where{stream.id(), stream.device_index()};
        std::string key(reinterpret_cast<const char*>(&where), sizeof(where));
        key.append(reinterpret_cast<const char*>(entries.data()), bytes);
        std::lock_guard<std::mutex> lock(mutex_);
        auto found = tables_.find(key);
        if (found != tables_.end()) {
            order_.splice(order_.begin(), order_, found->second.second);  // most recently used first
            return found->second.first.data_ptr();
        }
        at::Tensor table = upload(entries.data(), bytes, stream.device());
        if (seen_.insert(std::hash<std::string>()(key)).second) {  // first sighting: for this call only
            if (seen_.size() > kMaxSeen) seen_.clear();
            scratch = table;
            return table.data_ptr();
        }
        order_.push_front(key);
        tables_.emplace(std::move(key), std::make_pair(table, order_.begin()));
        while (tables_.size() > kMaxTables) {
            tables_.erase(order_.back());
            order_.pop_back();
        }
        return table.data_ptr();
    }

private:
    struct StreamKey {
        int64_t stream_id;
        int64_t device;
    };

    // Pinned staging, copied on the current stream (the caching host allocator keeps the pinned block until the
    // copy has run).
    static at::Tensor upload(const void* data, size_t bytes, const at::Device& device) {
        at::Tensor host =
            at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
        std::memcpy(host.data_ptr(), data, bytes);
        return host.to(device, /*non_blocking=*/true);
    }

    std::mutex mutex_;
    std::unordered_set<size_t> seen_;
    std::list<std::string> order_;
    std::unordered_map<std::string, std::pair<at::Tensor, std::list<std::string>::iterator>> tables_;
};

}  // namespace dsa
