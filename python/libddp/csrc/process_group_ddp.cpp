// The torch.distributed backend "ddp": a c10d::ProcessGroup over a libddp group.
//
// Rendezvous runs through the c10d::Store torch hands the backend (a PrefixStore per group),
// wrapped as a libddp callback store, so the backend works wherever init_process_group works.
// Every collective is issued asynchronously on the libddp group's progress thread; its Work
// holds a c10 Future that libddp's ddp_work_on_complete callback completes (no thread per work),
// so DDP's comm hooks chain on getFuture() as they do with gloo. Contiguous CPU tensors are
// handed to libddp in place; a non-contiguous one goes through a contiguous copy and is copied
// back when the work completes. Each op maps onto the libddp group operation of the same name
// (docs/pytorch.md lists them); an op libddp has no counterpart for raises a RuntimeError naming
// the op.
//
// Torch-version differences stay in the block below and in a few `#if LIBDDP_TORCH2` guards
// around what only one side has: torch 1.13 subclasses c10d::ProcessGroup; torch >= 2.0 moved
// the collectives to c10d::Backend (ProcessGroup became the dispatcher in front of backends),
// with the same virtuals plus the coalesced tensor ops, coalescing, shutdown and abort.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#define LIBDDP_TORCH2 1
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#define LIBDDP_TORCH2 0
#endif

#include <pybind11/chrono.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/ddp.h"

namespace libddp_torch {

#if LIBDDP_TORCH2
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif

// Set on this thread while one of torch's blocking collective functions runs, by libddp.torch's
// wrappers of them (torch < 2.7 only: its options have no `asyncOp`, and its dist.all_reduce(t)
// asks for an async Work and waits for it at once). See set_caller_waits below.
static thread_local bool caller_waits = false;

// Whether the caller may leave the Work outstanding (async_op=True) rather than wait for it at
// once: torch >= 2.7 says so in the options (`asyncOp`); for older ones libddp.torch's wrappers
// of the blocking functions say so through caller_waits, and anything else counts as async.
template <typename Opts>
static auto is_async(const Opts& o, int) -> decltype(bool(o.asyncOp)) {
    return o.asyncOp;
}
template <typename Opts>
static bool is_async(const Opts&, long) {
    return !caller_waits;
}
template <typename Opts>
static bool is_async(const Opts& o) {
    return is_async(o, 0);
}
template <typename Opts, typename = void>
struct has_async_op : std::false_type {};
template <typename Opts>
struct has_async_op<Opts, decltype(void(std::declval<Opts&>().asyncOp))> : std::true_type {};

// ---- the store adapter ------------------------------------------------------------------------

// Runs fn; an exception becomes a status and its text (timeouts recognised by their text, which
// is how c10d's stores report them).
template <typename Fn>
static ddp_status_t guarded(Fn fn, char* error, size_t error_size) {
    try {
        fn();
        return DDP_OK;
    } catch (const std::exception& e) {
        snprintf(error, error_size, "torch store: %s", e.what());
        std::string what = e.what();
        if (what.find("imeout") != std::string::npos || what.find("timed out") != std::string::npos)
            return DDP_ERR_TIMEOUT;
        return DDP_ERR_REMOTE;
    }
}

static c10d::Store& store_of(void* ctx) {
    return **static_cast<c10::intrusive_ptr<c10d::Store>*>(ctx);
}

static void* malloc_copy(const std::vector<uint8_t>& v) {
    void* out = std::malloc(v.size() ? v.size() : 1);
    if (!out)
        throw std::bad_alloc();
    if (!v.empty())
        std::memcpy(out, v.data(), v.size());
    return out;
}

static ddp_status_t store_set(void* ctx, const char* key, const void* value, size_t len,
                              char* error, size_t error_size) {
    return guarded(
        [&] {
            const uint8_t* p = static_cast<const uint8_t*>(value);
            store_of(ctx).set(key, std::vector<uint8_t>(p, p + len));
        },
        error, error_size);
}

static ddp_status_t store_get(void* ctx, const char* key, int timeout_ms, void** value, size_t* len,
                              char* error, size_t error_size) {
    return guarded(
        [&] {
            store_of(ctx).wait({key}, std::chrono::milliseconds(timeout_ms));
            std::vector<uint8_t> v = store_of(ctx).get(key);
            *value = malloc_copy(v);
            *len = v.size();
        },
        error, error_size);
}

static ddp_status_t store_add(void* ctx, const char* key, int64_t delta, int64_t* result,
                              char* error, size_t error_size) {
    return guarded([&] { *result = store_of(ctx).add(key, delta); }, error, error_size);
}

static ddp_status_t store_wait(void* ctx, const char* const* keys, size_t nkeys, int timeout_ms,
                               char* error, size_t error_size) {
    std::vector<std::string> k(keys, keys + nkeys);
    ddp_status_t s = guarded([&] { store_of(ctx).wait(k, std::chrono::milliseconds(timeout_ms)); },
                             error, error_size);
    if (s != DDP_OK) {
        // torch's text does not say which keys; libddp's callers want them named.
        std::string missing;
        try {
            for (const auto& key : k)
                if (!store_of(ctx).check({key}))
                    missing += (missing.empty() ? "'" : ", '") + key + "'";
        } catch (const std::exception&) {
        }
        if (!missing.empty()) {
            size_t used = strlen(error);
            snprintf(error + used, error_size - used, " (missing: %s)", missing.c_str());
        }
    }
    return s;
}

static ddp_status_t store_compare_set(void* ctx, const char* key, const void* expected,
                                      size_t expected_len, const void* desired, size_t desired_len,
                                      void** current, size_t* current_len, char* error,
                                      size_t error_size) {
    return guarded(
        [&] {
            const uint8_t* e = static_cast<const uint8_t*>(expected);
            const uint8_t* d = static_cast<const uint8_t*>(desired);
            std::vector<uint8_t> v =
                store_of(ctx).compareSet(key, std::vector<uint8_t>(e, e + expected_len),
                                         std::vector<uint8_t>(d, d + desired_len));
            *current = malloc_copy(v);
            *current_len = v.size();
        },
        error, error_size);
}

static ddp_status_t store_check(void* ctx, const char* const* keys, size_t nkeys, int* all_exist,
                                char* error, size_t error_size) {
    return guarded(
        [&] {
            *all_exist = store_of(ctx).check(std::vector<std::string>(keys, keys + nkeys)) ? 1 : 0;
        },
        error, error_size);
}

static ddp_status_t store_remove(void* ctx, const char* key, int* deleted, char* error,
                                 size_t error_size) {
    return guarded([&] { *deleted = store_of(ctx).deleteKey(key) ? 1 : 0; }, error, error_size);
}

static ddp_status_t store_num_keys(void* ctx, int64_t* count, char* error, size_t error_size) {
    return guarded([&] { *count = store_of(ctx).getNumKeys(); }, error, error_size);
}

static void store_destroy(void* ctx) {
    delete static_cast<c10::intrusive_ptr<c10d::Store>*>(ctx);
}

// ---- dtypes and reduce ops ----------------------------------------------------------------------

static bool reducible_dtype(at::ScalarType t, ddp_dtype_t* out) {
    switch (t) {
        case at::kFloat:
            *out = DDP_F32;
            return true;
        case at::kDouble:
            *out = DDP_F64;
            return true;
        case at::kHalf:
            *out = DDP_F16;
            return true;
        case at::kBFloat16:
            *out = DDP_BF16;
            return true;
        case at::kInt:
            *out = DDP_I32;
            return true;
        case at::kLong:
            *out = DDP_I64;
            return true;
        case at::kByte:
            *out = DDP_U8;
            return true;
        case at::kBool:
            *out = DDP_U8;
            return true;
        // Complex tensors reduce as their real view (two reals per element), as gloo does: right
        // for the element-wise sums (SUM, AVG, PREMUL_SUM); reduction_of refuses the others.
        case at::kComplexFloat:
            *out = DDP_F32;
            return true;
        case at::kComplexDouble:
            *out = DDP_F64;
            return true;
        case at::kComplexHalf:
            *out = DDP_F16;
            return true;
        default:
            return false;
    }
}

// Elements libddp reduces for `t`: a complex element is two reals.
static size_t count_of(const at::Tensor& t) {
    return (size_t)t.numel() * (t.is_complex() ? 2 : 1);
}

static const char* op_name(c10d::ReduceOp::RedOpType op) {
    switch (op) {
        case c10d::ReduceOp::SUM:
            return "SUM";
        case c10d::ReduceOp::AVG:
            return "AVG";
        case c10d::ReduceOp::PRODUCT:
            return "PRODUCT";
        case c10d::ReduceOp::MIN:
            return "MIN";
        case c10d::ReduceOp::MAX:
            return "MAX";
        case c10d::ReduceOp::BAND:
            return "BAND";
        case c10d::ReduceOp::BOR:
            return "BOR";
        case c10d::ReduceOp::BXOR:
            return "BXOR";
        case c10d::ReduceOp::PREMUL_SUM:
            return "PREMUL_SUM";
        default:
            return "UNUSED";
    }
}

// The factor of a PREMUL_SUM (torch.distributed._make_nccl_premul_sum: a Python float or a
// one-element tensor), which the backend multiplies into the input before a SUM.
static double premul_factor(const c10d::ReduceOp& rop) {
    auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(rop.supplement_.get());
    TORCH_CHECK(sup, "libddp backend: ReduceOp.PREMUL_SUM without its factor");
#if LIBDDP_TORCH2
    if (sup->tensor_factor.defined())
        return sup->tensor_factor.item<double>();
#else
    if (!sup->tensor_factors.empty())
        return sup->tensor_factors[0].item<double>();
#endif
    return sup->double_factor;
}

// The libddp dtype and op of a reduction on `t` with `op`, or a RuntimeError naming both. A
// PREMUL_SUM is a SUM whose input the caller first multiplies by *premul (left at 1 otherwise).
static void reduction_of(const char* what, const at::Tensor& t, const c10d::ReduceOp& rop,
                         ddp_dtype_t* dtype, ddp_reduce_op_t* op, double* premul = nullptr) {
    auto o = static_cast<c10d::ReduceOp::RedOpType>(rop);
    TORCH_CHECK(reducible_dtype(t.scalar_type(), dtype), "libddp backend: ", what,
                " cannot reduce dtype ", t.scalar_type(),
                ": libddp reduces float32, float64, float16, bfloat16, int32, int64, uint8, bool "
                "and complex (SUM, AVG, PREMUL_SUM)");
    bool is_bool = t.scalar_type() == at::kBool;
    if (premul)
        *premul = 1.0;
    TORCH_CHECK(!t.is_complex() || o == c10d::ReduceOp::SUM || o == c10d::ReduceOp::AVG ||
                    o == c10d::ReduceOp::PREMUL_SUM,
                "libddp backend: ", what, " with ReduceOp.", op_name(o),
                " on a complex tensor is not defined (SUM, AVG and PREMUL_SUM are)");
    switch (o) {
        case c10d::ReduceOp::SUM:
            *op = DDP_SUM;
            break;
        case c10d::ReduceOp::PREMUL_SUM:
            TORCH_CHECK(premul, "libddp backend: ", what, " does not take ReduceOp.PREMUL_SUM");
            TORCH_CHECK(at::isFloatingType(t.scalar_type()) || t.is_complex(),
                        "libddp backend: ", what, " with ReduceOp.PREMUL_SUM takes a floating "
                        "point tensor, got ", t.scalar_type());
            *premul = premul_factor(rop);
            *op = DDP_SUM;
            break;
        case c10d::ReduceOp::AVG:
            *op = DDP_AVG;
            break;
        case c10d::ReduceOp::PRODUCT:
            *op = DDP_PROD;
            break;
        case c10d::ReduceOp::MIN:
            *op = DDP_MIN;
            break;
        case c10d::ReduceOp::MAX:
            *op = DDP_MAX;
            break;
        // On 0/1 values bitwise AND/OR are MIN/MAX; libddp has no bitwise ops for other dtypes.
        case c10d::ReduceOp::BAND:
            TORCH_CHECK(
                is_bool, "libddp backend: ", what,
                " with ReduceOp.BAND is supported only on bool tensors (libddp has no bitwise "
                "reductions), got ",
                t.scalar_type());
            *op = DDP_MIN;
            return;
        case c10d::ReduceOp::BOR:
            TORCH_CHECK(
                is_bool, "libddp backend: ", what,
                " with ReduceOp.BOR is supported only on bool tensors (libddp has no bitwise "
                "reductions), got ",
                t.scalar_type());
            *op = DDP_MAX;
            return;
        default:
            TORCH_CHECK(false, "libddp backend: ", what, " does not support ReduceOp.", op_name(o),
                        " (libddp reduces with SUM, AVG, PREMUL_SUM, PRODUCT, MIN, MAX; BAND/BOR on bool)");
    }
    TORCH_CHECK(!(is_bool && (*op == DDP_SUM || *op == DDP_AVG)), "libddp backend: ", what,
                " with ReduceOp.", op_name(o),
                " on bool tensors is not supported (use MAX/BOR, "
                "MIN/BAND or PRODUCT)");
}

static void check_cpu(const char* what, const at::Tensor& t) {
    TORCH_CHECK(t.device().is_cpu(), "libddp backend: ", what, " takes CPU tensors, got one on ",
                t.device());
    TORCH_CHECK(!t.is_sparse(), "libddp backend: ", what, " does not support sparse tensors");
}

static void check_single(const char* what, const std::vector<at::Tensor>& tensors) {
    TORCH_CHECK(tensors.size() == 1, "libddp backend: ", what,
                " takes exactly one tensor per call (one CPU device per rank), got ",
                tensors.size());
    check_cpu(what, tensors[0]);
}

// ---- works ------------------------------------------------------------------------------------

class ProcessGroupDDP;

// One torch Work over one or more libddp works issued back to back (they complete in issue
// order, so the last one's completion completes the whole). `finish` runs on the progress thread
// before the future completes: copies back out of temporaries.
class WorkDDP : public c10d::Work {
  public:
    // `profiling_title` ("ddp:all_reduce", ...) makes c10d::Work open a profiler record that
    // end_profiling() closes when the work completes.
    WorkDDP(int rank, c10d::OpType type, const char* profiling_title,
            std::vector<at::Tensor> outputs)
        : c10d::Work(rank, type, profiling_title),
          outputs_(std::move(outputs)),
          future_(c10::make_intrusive<c10::ivalue::Future>(
              c10::ListType::create(c10::TensorType::get()))) {}

    ~WorkDDP() override {
        for (ddp_work_t* w : works_)
            ddp_work_free(w);
    }

    bool isCompleted() override { return future_->completed(); }
    bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
    std::exception_ptr exception() const override { return future_->exception_ptr(); }
    std::vector<at::Tensor> result() override { return outputs_; }
    int sourceRank() const override {
        TORCH_CHECK(source_rank_ >= 0, "libddp backend: sourceRank() is defined for a recv from "
                    "any source only");
        return source_rank_;
    }

    void end_profiling() {
        if (recordFunctionEndCallback_) {
            recordFunctionEndCallback_();
            recordFunctionEndCallback_ = nullptr;
        }
    }
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

    bool wait(std::chrono::milliseconds timeout) override {
        // libddp bounds every collective by the group's timeout, so the future always completes;
        // a shorter timeout asked here is honoured by polling the future.
        if (timeout == kNoTimeout) {
            future_->wait();
        } else {
            auto deadline = std::chrono::steady_clock::now() + timeout;
            while (!future_->completed()) {
                TORCH_CHECK(std::chrono::steady_clock::now() < deadline,
                            "libddp backend: Work::wait timed out after ", timeout.count(), " ms");
                std::this_thread::sleep_for(std::chrono::microseconds(200));
            }
        }
        if (future_->hasError())
            std::rethrow_exception(future_->exception_ptr());
        return true;
    }

    void abort() override {
        TORCH_CHECK(false,
                    "libddp backend: Work::abort is not supported (a failed collective "
                    "breaks the group on every rank instead; ProcessGroup.abort() aborts the "
                    "whole group)");
    }

    std::vector<at::Tensor> outputs_;
    std::vector<at::Tensor> keep_;    // temporaries and inputs alive until completion
    std::function<void()> finish_;    // copies out of temporaries, on success
    std::vector<ddp_work_t*> works_;  // handles to free
    std::string what_;                // the op, for error texts
    int rank_in_group_ = 0;
    int source_rank_ = -1;            // the sender of a recv from any source
    c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// Heap-held reference that keeps the Work alive until libddp calls back.
struct Completion {
    c10::intrusive_ptr<WorkDDP> work;
    std::atomic<int>* outstanding;  // the group's count of Works not yet completed
    const ddp_group_t* group;       // the libddp group the work ran on
};

// The group whose completion this thread is running (set around the future's completion, which
// runs the callbacks chained on it). On libddp's progress thread a callback that issues a
// collective and waits for it (torch's PowerSGD hook does: allreduce(P).wait() inside a then())
// would wait for the very thread it blocks; such collectives run inline instead (libddp executes
// a blocking call on the progress thread at once, as the next sequence number on every rank).
static thread_local const ddp_group_t* completing_group = nullptr;

static void on_complete(void* arg, ddp_status_t status) {
    Completion* c = static_cast<Completion*>(arg);
    WorkDDP& w = *c->work;
    std::exception_ptr error;
    if (status != DDP_OK) {
        // Inside the callback ddp_last_error() is the work's own text: which rank, what failed.
        std::string text = ddp_last_error();
        // A timeout says so in c10d's words too ("Timed out"), which torch's own tests and
        // tools match on (gloo's and the stores' texts), beside libddp's status name.
        std::string kind = status == DDP_ERR_TIMEOUT ? std::string("Timed out (") +
                                                           ddp_status_string(status) + ")"
                                                     : std::string(ddp_status_string(status));
        error = std::make_exception_ptr(std::runtime_error(
            "libddp backend: " + w.what_ + " failed on rank " + std::to_string(w.rank_in_group_) +
            ": " + kind + ": " + (text.empty() ? "(no detail)" : text)));
    } else {
        try {
            at::NoGradGuard no_grad;
            if (w.finish_)
                w.finish_();
        } catch (const std::exception& e) {
            error = std::make_exception_ptr(std::runtime_error(
                "libddp backend: " + w.what_ + ": copying the result out failed: " + e.what()));
        }
    }
    w.keep_.clear();
    w.finish_ = nullptr;
    w.end_profiling();
    // No longer in flight before the waiter wakes: the training thread that waited on this Work
    // issues its next small collective inline rather than seeing this one still outstanding.
    c->outstanding->fetch_sub(1);
    const ddp_group_t* outer = completing_group;  // a run_inline inside a callback nests
    completing_group = c->group;
    try {
        if (error)
            w.future_->setError(error);
        else
            w.future_->markCompleted(c10::IValue(w.outputs_));
    } catch (const std::exception&) {
        // A future callback threw: c10's Future logs and swallows callback errors itself; nothing
        // may escape into libddp's progress thread.
    }
    completing_group = outer;
    delete c;
}

// ---- the process group --------------------------------------------------------------------------

class ProcessGroupDDP : public BackendBase {
  public:
    ProcessGroupDDP(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                    std::chrono::milliseconds timeout)
        : BackendBase(rank, size) {
        torch_store_ = store;
        ddp_store_callbacks_t cb{};
        cb.ctx = new c10::intrusive_ptr<c10d::Store>(store);
        cb.set = store_set;
        cb.get = store_get;
        cb.add = store_add;
        cb.wait = store_wait;
        cb.compare_set = store_compare_set;
        cb.check = store_check;
        cb.remove = store_remove;
        cb.num_keys = store_num_keys;
        cb.destroy = store_destroy;
        long long ms = timeout.count();
        int timeout_ms = ms <= 0 ? 0 : (int)std::min<long long>(ms, 24LL * 3600 * 1000);
        ddp_status_t s = ddp_store_callback_create(&cb, timeout_ms, &store_);
        if (s != DDP_OK) {
            store_destroy(cb.ctx);
            TORCH_CHECK(false,
                        "libddp backend: wrapping torch's store failed: ", ddp_status_string(s),
                        ": ", ddp_last_error());
        }
        ddp_group_options_t options = DDP_GROUP_OPTIONS_INIT;
        options.timeout_ms = timeout_ms;
        s = ddp_group_create(store_, rank, size, &options, &group_);
        if (s != DDP_OK) {
            std::string text = ddp_last_error();
            ddp_store_destroy(store_);
            TORCH_CHECK(false, "libddp backend: creating the group on rank ", rank, " of ", size,
                        " failed: ", ddp_status_string(s), ": ", text);
        }
        // torch's recv without src (recvAnysource) may come at any time, so every send of the
        // group announces itself (one store add per send; include/ddp/group.h).
        s = ddp_group_enable_recv_any(group_);
        if (s != DDP_OK) {
            std::string text = ddp_last_error();
            ddp_group_destroy(group_);
            ddp_store_destroy(store_);
            TORCH_CHECK(false, "libddp backend: enabling recv from any source on rank ", rank,
                        " failed: ", ddp_status_string(s), ": ", text);
        }
    }

    ~ProcessGroupDDP() override { close(); }

    // Waits for queued works and frees the libddp group and its store (once; later calls do
    // nothing). torch >= 2 calls shutdown() from destroy_process_group, so the group goes while
    // the interpreter is whole rather than in a destructor at exit.
    void close() {
        std::lock_guard<std::mutex> lock(close_mu_);
        if (!group_)
            return;
        // Destroy waits for queued works, whose completions may run Python callbacks (comm
        // hooks): they need the GIL, which the calling thread may hold.
        if (Py_IsInitialized() && PyGILState_Check()) {
            py::gil_scoped_release release;
            ddp_group_destroy(group_);
        } else {
            ddp_group_destroy(group_);
        }
        group_ = nullptr;
        ddp_store_destroy(store_);
        store_ = nullptr;
    }

#if LIBDDP_TORCH2
    void shutdown() override { close(); }

    // Fails what is queued or running here and on the peers (they learn through the transport),
    // then frees the group: torch's abort paths (destroy_process_group after a failure,
    // _abort_process_group) must not wait for a collective that will never complete.
    void abort() override {
        {
            std::lock_guard<std::mutex> lock(close_mu_);
            if (group_)
                ddp_group_abort(group_, "ProcessGroup.abort() was called");
        }
        close();
    }

    bool supportsCoalescing() const override { return true; }

    // Between startCoalescing and endCoalescing (torch's _coalescing_manager, batch_isend_irecv)
    // each op is issued as usual; endCoalescing returns one Work that completes with the last of
    // them (libddp runs a group's works in issue order).
    void startCoalescing() override {
        TORCH_CHECK(!coalescing_, "libddp backend: startCoalescing while already coalescing");
        coalescing_ = true;
        coalesced_.clear();
        deferred_p2p_.clear();
    }

    c10::intrusive_ptr<c10d::Work> endCoalescing() override {
        TORCH_CHECK(coalescing_, "libddp backend: endCoalescing without startCoalescing");
        coalescing_ = false;
        issue_deferred_p2p();
        std::vector<c10::intrusive_ptr<WorkDDP>> works;
        works.swap(coalesced_);
        std::vector<at::Tensor> outs;
        for (auto& w : works)
            outs.insert(outs.end(), w->outputs_.begin(), w->outputs_.end());
        auto all = make_work(c10d::OpType::COALESCED, "coalesced", outs);
        if (works.empty()) {
            all->future_->markCompleted(c10::IValue(all->outputs_));
            return all;
        }
        // Completes when every member has; the first member's error is the whole's.
        auto left = std::make_shared<std::atomic<size_t>>(works.size());
        for (auto& w : works) {
            c10::intrusive_ptr<WorkDDP> whole = all;
            std::vector<c10::intrusive_ptr<WorkDDP>> members = works;
            w->future_->addCallback([whole, members, left](c10::ivalue::Future&) {
                if (left->fetch_sub(1) != 1)
                    return;
                for (auto& m : members)
                    if (m->future_->hasError()) {
                        whole->future_->setError(m->future_->exception_ptr());
                        return;
                    }
                whole->future_->markCompleted(c10::IValue(whole->outputs_));
            });
        }
        return all;
    }
#endif

    const std::string getBackendName() const override { return "ddp"; }

    // Sequence numbers (TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper compares them across ranks before
    // each collective): as gloo's, every rank starts at 0 and counts the collectives it issued;
    // sends and recvs, which only two ranks issue, are not counted.
    void setSequenceNumberForGroup() override { sequence_number_ = 0; }
    uint64_t getSequenceNumberForGroup() override { return sequence_number_.load(); }
    std::string transport() const { return ddp_group_transport(group_); }
    int timeoutMs() const { return ddp_group_timeout_ms(group_); }
    uint64_t inlineRuns() const { return inline_runs_.load(std::memory_order_relaxed); }

    // ---- natively supported --------------------------------------------------------------------

    c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                             const c10d::AllreduceOptions& opts) override {
        if (tensors.size() == 1 && tensors[0].is_sparse())
            return allreduce_sparse(tensors[0], opts);
        check_single("allreduce", tensors);
        ddp_dtype_t dt;
        ddp_reduce_op_t op;
        double premul;
        reduction_of("allreduce", tensors[0], opts.reduceOp, &dt, &op, &premul);
        auto w = make_work(c10d::OpType::ALLREDUCE, "allreduce", tensors);
        at::Tensor buf = in_place_buffer(*w, tensors[0]);
        if (premul != 1.0)
            buf.mul_(premul);  // in place: the result overwrites it anyway
        if (can_run_inline(bytes_of(buf), is_async(opts)))
            return run_inline(w, [&] {
                return ddp_group_allreduce(group_, buf.data_ptr(), buf.data_ptr(), count_of(buf),
                                           dt, op);
            });
        issue(*w, [&](ddp_work_t** h) {
            return ddp_group_allreduce_async(group_, buf.data_ptr(), buf.data_ptr(),
                                             count_of(buf), dt, op, h);
        });
        return launch(w);
    }

    c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
        std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
        TORCH_CHECK(!tensors.empty(), "libddp backend: allreduce_coalesced got no tensors");
        ddp_dtype_t dt;
        ddp_reduce_op_t op;
        double premul = 1.0;
        for (auto& t : tensors) {
            check_cpu("allreduce_coalesced", t);
            reduction_of("allreduce_coalesced", t, opts.reduceOp, &dt, &op, &premul);
        }
        auto w = make_work(c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors);
        bool one_dtype = true;
        for (auto& t : tensors)
            one_dtype = one_dtype && t.scalar_type() == tensors[0].scalar_type();
        if (one_dtype) {
            // One libddp operation: packed, reduced once, unpacked (one latency for all).
            std::vector<void*> bufs;
            std::vector<size_t> counts;
            size_t total = 0;
            for (auto& t : tensors) {
                at::Tensor b = in_place_buffer(*w, t);
                if (premul != 1.0)
                    b.mul_(premul);
                bufs.push_back(b.data_ptr());
                counts.push_back(count_of(b));
                total += bytes_of(b);
            }
            if (can_run_inline(total, is_async(opts)))
                return run_inline(w, [&] {
                    return ddp_group_allreduce_coalesced(group_, bufs.data(), counts.data(),
                                                         bufs.size(), dt, op);
                });
            issue(*w, [&](ddp_work_t** h) {
                return ddp_group_allreduce_coalesced_async(group_, bufs.data(), counts.data(),
                                                           bufs.size(), dt, op, h);
            });
            return launch(w);
        }
        // One libddp allreduce per tensor, issued back to back: each is zero copy, and they run in
        // issue order, so the last one's completion completes the whole.
        for (auto& t : tensors) {
            reduction_of("allreduce_coalesced", t, opts.reduceOp, &dt, &op, &premul);
            at::Tensor buf = in_place_buffer(*w, t);
            if (premul != 1.0)
                buf.mul_(premul);
            issue(*w, [&](ddp_work_t** h) {
                return ddp_group_allreduce_async(group_, buf.data_ptr(), buf.data_ptr(),
                                                 count_of(buf), dt, op, h);
            });
        }
        return launch(w);
    }

    c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const c10d::BroadcastOptions& opts) override {
        check_single("broadcast", tensors);
        check_root("broadcast", opts.rootRank);
        auto w = make_work(c10d::OpType::BROADCAST, "broadcast", tensors);
        at::Tensor buf = in_place_buffer(*w, tensors[0]);
        int root = (int)opts.rootRank;
        if (can_run_inline(bytes_of(buf), is_async(opts)))
            return run_inline(w, [&] {
                return ddp_group_broadcast(group_, buf.data_ptr(), bytes_of(buf), DDP_U8, root);
            });
        issue(*w, [&](ddp_work_t** h) {
            return ddp_group_broadcast_async(group_, buf.data_ptr(), bytes_of(buf), DDP_U8,
                                             (int)opts.rootRank, h);
        });
        return launch(w);
    }

    c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                   const c10d::AllgatherOptions& opts) override {
        check_allgather_pair("_allgather_base", output, input);
        std::vector<at::Tensor> outs{output};
        auto w = make_work(c10d::OpType::_ALLGATHER_BASE, "_allgather_base", outs);
        at::Tensor in = input.contiguous();
        w->keep_.push_back(in);
        at::Tensor out = in_place_buffer(*w, output);
        return run_or_issue(
            w, bytes_of(out), is_async(opts),
            [&] {
                return ddp_group_allgather(group_, in.data_ptr(), out.data_ptr(), bytes_of(in),
                                           DDP_U8);
            },
            [&](ddp_work_t** h) {
                return ddp_group_allgather_async(group_, in.data_ptr(), out.data_ptr(),
                                                 bytes_of(in), DDP_U8, h);
            });
    }

    c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                             std::vector<at::Tensor>& inputs,
                                             const c10d::AllgatherOptions&) override {
        check_single("allgather", inputs);
        TORCH_CHECK(outputs.size() == 1, "libddp backend: allgather takes one output list, got ",
                    outputs.size());
        check_gather_list("allgather", outputs[0], inputs[0]);
        auto w = make_work(c10d::OpType::ALLGATHER, "allgather", outputs[0]);
        issue_gather_into_temp(*w, inputs[0], outputs[0]);
        return launch(w);
    }

    // torch's layout (all_gather_coalesced): outputs[r][i] receives rank r's inputs[i]. The
    // inputs travel packed as one byte buffer, one allgather for all of them.
    c10::intrusive_ptr<c10d::Work> allgather_coalesced(
        std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
        const c10d::AllgatherOptions&) override {
        TORCH_CHECK(!inputs.empty(), "libddp backend: allgather_coalesced got no tensors");
        TORCH_CHECK((int)outputs.size() == getSize(), "libddp backend: allgather_coalesced takes ",
                    getSize(), " output lists (one per rank), got ", outputs.size());
        for (auto& t : inputs)
            check_cpu("allgather_coalesced", t);
        for (size_t r = 0; r < outputs.size(); r++) {
            TORCH_CHECK(outputs[r].size() == inputs.size(), "libddp backend: allgather_coalesced: "
                        "output list ", r, " has ", outputs[r].size(), " tensors for ",
                        inputs.size(), " inputs");
            for (size_t i = 0; i < inputs.size(); i++) {
                check_cpu("allgather_coalesced", outputs[r][i]);
                check_same_dtype("allgather_coalesced", outputs[r][i], inputs[i]);
                TORCH_CHECK(outputs[r][i].numel() == inputs[i].numel(), "libddp backend: "
                            "allgather_coalesced: output [", r, "][", i, "] has ",
                            outputs[r][i].numel(), " elements, its input ", inputs[i].numel());
            }
        }
        std::vector<at::Tensor> all;
        for (auto& o : outputs)
            all.insert(all.end(), o.begin(), o.end());
        auto w = make_work(c10d::OpType::ALLGATHER_COALESCED, "allgather_coalesced", all);
        std::vector<at::Tensor> bytes;
        for (auto& t : inputs)
            bytes.push_back(t.contiguous().reshape({-1}).view(at::kByte));
        at::Tensor in = at::cat(bytes);
        at::Tensor gathered = at::empty({getSize() * in.numel()}, in.options());
        w->keep_.push_back(in);
        w->keep_.push_back(gathered);
        int64_t per_rank = in.numel();
        std::vector<std::vector<at::Tensor>> targets = outputs;
        w->finish_ = [gathered, targets, per_rank]() mutable {
            for (size_t r = 0; r < targets.size(); r++) {
                int64_t at = (int64_t)r * per_rank;
                for (auto& t : targets[r]) {
                    int64_t n = t.numel() * t.element_size();
                    at::Tensor src = gathered.narrow(0, at, n).view(t.scalar_type());
                    t.copy_(src.view(t.sizes()));
                    at += n;
                }
            }
        };
        issue(*w, [&](ddp_work_t** h) {
            return ddp_group_allgather_async(group_, in.data_ptr(), gathered.data_ptr(),
                                             (size_t)in.numel(), DDP_U8, h);
        });
        return launch(w);
    }

#if LIBDDP_TORCH2
    // Coalesced all_gather_into_tensor (torch's _coalescing_manager, FSDP2, DeepSpeed): one
    // libddp allgather per pair, issued back to back; the last one's completion completes all.
    c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
        std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
        const c10d::AllgatherOptions&) override {
        TORCH_CHECK(!inputs.empty() && outputs.size() == inputs.size(),
                    "libddp backend: allgather_into_tensor_coalesced takes as many outputs as "
                    "inputs (at least one), got ", outputs.size(), " and ", inputs.size());
        for (size_t i = 0; i < inputs.size(); i++)
            check_allgather_pair("allgather_into_tensor_coalesced", outputs[i], inputs[i]);
        auto w = make_work(c10d::OpType::COALESCED, "allgather_into_tensor_coalesced", outputs);
        for (size_t i = 0; i < inputs.size(); i++)
            issue_allgather(*w, outputs[i], inputs[i]);
        return launch(w);
    }

    // Coalesced reduce_scatter_tensor, the same way.
    c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
        std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
        const c10d::ReduceScatterOptions& opts) override {
        TORCH_CHECK(!inputs.empty() && outputs.size() == inputs.size(),
                    "libddp backend: reduce_scatter_tensor_coalesced takes as many outputs as "
                    "inputs (at least one), got ", outputs.size(), " and ", inputs.size());
        for (size_t i = 0; i < inputs.size(); i++)
            check_reduce_scatter_pair("reduce_scatter_tensor_coalesced", outputs[i], inputs[i]);
        auto w = make_work(c10d::OpType::COALESCED, "reduce_scatter_tensor_coalesced", outputs);
        for (size_t i = 0; i < inputs.size(); i++)
            issue_reduce_scatter(*w, outputs[i], inputs[i], opts);
        return launch(w);
    }
#endif

    c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
        at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
        check_reduce_scatter_pair("_reduce_scatter_base", output, input);
        std::vector<at::Tensor> outs{output};
        auto w = make_work(c10d::OpType::_REDUCE_SCATTER_BASE, "_reduce_scatter_base", outs);
        ddp_dtype_t dt;
        ddp_reduce_op_t op;
        at::Tensor in = reduce_scatter_input(*w, input, opts, &dt, &op);
        at::Tensor out = in_place_buffer(*w, output);
        return run_or_issue(
            w, bytes_of(in), is_async(opts),
            [&] {
                return ddp_group_reduce_scatter(group_, in.data_ptr(), out.data_ptr(),
                                                count_of(out), dt, op);
            },
            [&](ddp_work_t** h) {
                return ddp_group_reduce_scatter_async(group_, in.data_ptr(), out.data_ptr(),
                                                      count_of(out), dt, op, h);
            });
    }

    c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                  const c10d::ReduceScatterOptions& opts) override {
        check_single("reduce_scatter", outputs);
        TORCH_CHECK(inputs.size() == 1, "libddp backend: reduce_scatter takes one input list");
        check_gather_list("reduce_scatter", inputs[0], outputs[0]);
        auto w = make_work(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", outputs);
        // The input list is packed into one buffer (one copy in); the output is written in place.
        issue_reduce_scatter(*w, outputs[0], at::cat(flat_views(inputs[0])), opts);
        return launch(w);
    }

    c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
        std::vector<at::Tensor> none;
        auto w = make_work(c10d::OpType::BARRIER, "barrier", none);
        if (can_run_inline(0, is_async(opts)))
            return run_inline(w, [&] { return ddp_group_barrier(group_); });
        issue(*w, [&](ddp_work_t** h) { return ddp_group_barrier_async(group_, h); });
        return launch(w);
    }

    // torch.distributed.monitored_barrier: rank 0 waits for every other rank in rank order
    // until the timeout and raises naming the first rank that did not arrive (every such rank,
    // with wait_all_ranks); the others raise when rank 0 does. Carried by torch's store, not by
    // the group, so a rank that never comes poisons nothing: the group stays usable, and the
    // diagnosis does not depend on the transport. Keys are per call (a counter every rank of
    // the group advances alike); rank 0 removes the arrival keys once it has seen them.
    void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
        using clock = std::chrono::steady_clock;
        auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(opts.timeout);
        auto deadline = clock::now() + timeout;
        std::string base = "libddp/monitored_barrier/" + std::to_string(monitored_seq_++) + "/";
        c10d::Store& store = *torch_store_;
        auto left = [&] {
            return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
        };
        // True if key exists before the deadline. Polled with check() (1 to 10 ms apart): the
        // store's own wait() prints a warning on every timeout, and a missing rank is the case
        // this call is for.
        auto arrives = [&](const std::string& key) {
            auto nap = std::chrono::milliseconds(1);
            for (;;) {
                if (store.check({key}))
                    return true;
                auto ms = left();
                if (ms.count() <= 0)
                    return false;
                std::this_thread::sleep_for(std::min(nap, ms));
                nap = std::min(nap * 2, std::chrono::milliseconds(10));
            }
        };
        const std::vector<uint8_t> ok{'o', 'k'}, failed{'n', 'o'};
        int rank = getRank();
        if (rank != 0) {
            store.set(base + "arrive/" + std::to_string(rank), std::vector<uint8_t>(1, 1));
            bool released = arrives(base + "release") && store.get(base + "release") == ok;
            TORCH_CHECK(released,
                        "Rank ", rank, " successfully reached monitoredBarrier, but received "
                        "errors while waiting for send/recv from rank 0. Please check rank 0's "
                        "error for the rank that did not arrive.");
            return;
        }
        TORCH_CHECK(timeout.count() > 0 || getSize() == 1, "Rank 0 timed out in monitoredBarrier "
                    "after ", timeout.count(), " ms: the timeout leaves no time to wait for rank 1");
        std::vector<int> missing;
        for (int r = 1; r < getSize(); r++) {
            std::string key = base + "arrive/" + std::to_string(r);
            if (arrives(key)) {
                store.deleteKey(key);
                continue;
            }
            missing.push_back(r);
            if (!wait_all_ranks)
                break;
        }
        if (missing.empty()) {
            store.set(base + "release", ok);
            return;
        }
        store.set(base + "release", failed);
        std::string ranks;
        for (size_t i = 0; i < missing.size(); i++)
            ranks += (i ? ", " : "") + std::to_string(missing[i]);
        TORCH_CHECK(false, wait_all_ranks ? "Ranks " : "Rank ", ranks,
                    " failed to pass monitoredBarrier in ", timeout.count(), " ms (rank 0 waited "
                    "for every rank of the group in rank order", wait_all_ranks ? "" :
                    "; the first missing one is named, wait_all_ranks=True names every one", ")");
    }

    c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                          const c10d::ReduceOptions& opts) override {
        check_single("reduce", tensors);
        check_root("reduce", opts.rootRank);
        ddp_dtype_t dt;
        ddp_reduce_op_t op;
        double premul;
        reduction_of("reduce", tensors[0], opts.reduceOp, &dt, &op, &premul);
        auto w = make_work(c10d::OpType::REDUCE, "reduce", tensors);
        int root = (int)opts.rootRank;
        if (getRank() == root) {
            at::Tensor buf = in_place_buffer(*w, tensors[0]);
            if (premul != 1.0)
                buf.mul_(premul);
            issue(*w, [&](ddp_work_t** h) {
                return ddp_group_reduce_async(group_, buf.data_ptr(), buf.data_ptr(),
                                              count_of(buf), dt, op, root, h);
            });
        } else {
            // The input of a non-root rank is left as it was.
            at::Tensor in = premul != 1.0 ? tensors[0] * premul : tensors[0].contiguous();
            w->keep_.push_back(in);
            issue(*w, [&](ddp_work_t** h) {
                return ddp_group_reduce_async(group_, in.data_ptr(), nullptr, count_of(in), dt, op,
                                              root, h);
            });
        }
        return launch(w);
    }

    c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::GatherOptions& opts) override {
        check_single("gather", inputs);
        check_root("gather", opts.rootRank);
        bool root = getRank() == opts.rootRank;
        if (root) {
            TORCH_CHECK(outputs.size() == 1,
                        "libddp backend: gather on the root takes one output "
                        "list, got ",
                        outputs.size());
            check_gather_list("gather", outputs[0], inputs[0]);
        } else {
            TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                        "libddp backend: gather: only the root (rank ", opts.rootRank,
                        ") passes output tensors");
        }
        std::vector<at::Tensor> none;
        auto w = make_work(c10d::OpType::GATHER, "gather", root ? outputs[0] : none);
        at::Tensor in = inputs[0].contiguous();
        w->keep_.push_back(in);
        at::Tensor all;
        if (root) {
            all = at::empty({getSize() * in.numel()}, in.options());
            w->keep_.push_back(all);
            std::vector<at::Tensor> targets = outputs[0];
            int64_t n = in.numel();
            w->finish_ = [all, targets, n]() mutable {
                for (size_t j = 0; j < targets.size(); j++)
                    targets[j].copy_(all.narrow(0, (int64_t)j * n, n).view(targets[j].sizes()));
            };
        }
        int r = (int)opts.rootRank;
        issue(*w, [&](ddp_work_t** h) {
            return ddp_group_gather_async(group_, in.data_ptr(), root ? all.data_ptr() : nullptr,
                                          bytes_of(in), DDP_U8, r, h);
        });
        return launch(w);
    }

    c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                           std::vector<std::vector<at::Tensor>>& inputs,
                                           const c10d::ScatterOptions& opts) override {
        check_single("scatter", outputs);
        check_root("scatter", opts.rootRank);
        bool root = getRank() == opts.rootRank;
        at::Tensor flat;
        if (root) {
            TORCH_CHECK(inputs.size() == 1,
                        "libddp backend: scatter on the root takes one input "
                        "list, got ",
                        inputs.size());
            check_gather_list("scatter", inputs[0], outputs[0]);
            flat = at::cat(flat_views(inputs[0]));
        } else {
            TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                        "libddp backend: scatter: only the root (rank ", opts.rootRank,
                        ") passes input tensors");
        }
        auto w = make_work(c10d::OpType::SCATTER, "scatter", outputs);
        if (root)
            w->keep_.push_back(flat);
        at::Tensor out = in_place_buffer(*w, outputs[0]);
        int r = (int)opts.rootRank;
        issue(*w, [&](ddp_work_t** h) {
            return ddp_group_scatter_async(group_, root ? flat.data_ptr() : nullptr, out.data_ptr(),
                                           bytes_of(out), DDP_U8, r, h);
        });
        return launch(w);
    }

    c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                                 std::vector<int64_t>& outputSplitSizes,
                                                 std::vector<int64_t>& inputSplitSizes,
                                                 const c10d::AllToAllOptions& opts) override {
        check_cpu("alltoall_base", output);
        check_cpu("alltoall_base", input);
        check_same_dtype("alltoall_base", input, output);
        int world = getSize();
        std::vector<at::Tensor> outs{output};
        auto w = make_work(c10d::OpType::ALLTOALL_BASE, "alltoall_base", outs);
        at::Tensor in = input.contiguous();
        w->keep_.push_back(in);
        at::Tensor out = in_place_buffer(*w, output);
        if (inputSplitSizes.empty() && outputSplitSizes.empty()) {
            TORCH_CHECK(input.numel() == output.numel() && input.numel() % world == 0,
                        "libddp backend: alltoall_base: input (", input.numel(), ") and output (",
                        output.numel(), ") must have equal sizes divisible by ", world);
            return run_or_issue(
                w, bytes_of(in), is_async(opts),
                [&] {
                    return ddp_group_alltoall(group_, in.data_ptr(), out.data_ptr(),
                                              bytes_of(in) / world, DDP_U8);
                },
                [&](ddp_work_t** h) {
                    return ddp_group_alltoall_async(group_, in.data_ptr(), out.data_ptr(),
                                                    bytes_of(in) / world, DDP_U8, h);
                });
        }
        // Splits count rows of the first dimension; libddp counts bytes here.
        auto counts = [&](const std::vector<int64_t>& splits, const at::Tensor& t) {
            std::vector<size_t> c(world);
            int64_t row = t.dim() ? t.numel() / std::max<int64_t>(t.size(0), 1) : 1;
            for (int j = 0; j < world; j++)
                c[j] = splits.empty() ? bytes_of(t) / world
                                      : (size_t)(splits[j] * row) * t.element_size();
            return c;
        };
        TORCH_CHECK((inputSplitSizes.empty() || (int)inputSplitSizes.size() == world) &&
                        (outputSplitSizes.empty() || (int)outputSplitSizes.size() == world),
                    "libddp backend: alltoall_base: split sizes must have ", world, " entries");
        std::vector<size_t> sc = counts(inputSplitSizes, in), rc = counts(outputSplitSizes, out);
        issue(*w, [&](ddp_work_t** h) {
            return ddp_group_alltoallv_async(group_, in.data_ptr(), sc.data(), nullptr,
                                             out.data_ptr(), rc.data(), nullptr, DDP_U8, h);
        });
        return launch(w);
    }

    c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                            std::vector<at::Tensor>& inputs,
                                            const c10d::AllToAllOptions&) override {
        int world = getSize();
        TORCH_CHECK((int)outputs.size() == world && (int)inputs.size() == world,
                    "libddp backend: alltoall takes ", world, " input and output tensors, got ",
                    inputs.size(), " and ", outputs.size());
        std::vector<size_t> sc(world), rc(world);
        for (int i = 0; i < world; i++) {
            check_cpu("alltoall", inputs[i]);
            check_cpu("alltoall", outputs[i]);
            check_same_dtype("alltoall", inputs[i], inputs[0]);
            check_same_dtype("alltoall", outputs[i], inputs[0]);
            sc[i] = bytes_of(inputs[i]);
            rc[i] = bytes_of(outputs[i]);
        }
        auto w = make_work(c10d::OpType::ALLTOALL, "alltoall", outputs);
        at::Tensor in = at::cat(flat_views(inputs));
        int64_t total = 0;
        for (auto& o : outputs)
            total += o.numel();
        at::Tensor all = at::empty({total}, in.options());
        w->keep_.push_back(in);
        w->keep_.push_back(all);
        std::vector<at::Tensor> outs = outputs;
        w->finish_ = [all, outs]() mutable {
            int64_t at = 0;
            for (auto& o : outs) {
                o.copy_(all.narrow(0, at, o.numel()).view(o.sizes()));
                at += o.numel();
            }
        };
        issue(*w, [&](ddp_work_t** h) {
            return ddp_group_alltoallv_async(group_, in.data_ptr(), sc.data(), nullptr,
                                             all.data_ptr(), rc.data(), nullptr, DDP_U8, h);
        });
        return launch(w);
    }

    c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                        int tag) override {
        check_single("send", tensors);
        check_root("send", dstRank);
        auto w = make_work(c10d::OpType::SEND, "send", tensors);
        at::Tensor buf = tensors[0].contiguous();
        w->keep_.push_back(buf);
        return issue_p2p(w, buf, dstRank, tag, true);
    }

    c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                        int tag) override {
        check_single("recv", tensors);
        check_root("recv", srcRank);
        auto w = make_work(c10d::OpType::RECV, "recv", tensors);
        at::Tensor buf = in_place_buffer(*w, tensors[0]);
        return issue_p2p(w, buf, srcRank, tag, false);
    }

    // recv without src: libddp picks the rank whose next message to this one is waiting (every
    // send of the group announced itself in the store) and writes it into the Work's source rank
    // before the Work completes.
    c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                                 int tag) override {
        check_single("recv from any source", tensors);
        auto w = make_work(c10d::OpType::RECVANYSOURCE, "recv from any source", tensors);
        at::Tensor buf = in_place_buffer(*w, tensors[0]);
        int* source = &w->source_rank_;
        issue(*w, [&](ddp_work_t** h) {
            return ddp_group_recv_any_async(group_, buf.data_ptr(), bytes_of(buf), DDP_U8, tag,
                                            source, h);
        });
        return launch(w);
    }

  private:
    c10::intrusive_ptr<c10d::Store> torch_store_;  // for monitoredBarrier
    uint64_t monitored_seq_ = 0;

    // SUM of sparse COO tensors, as gloo does it: every rank's (coalesced) indices and values
    // are gathered to every rank (three allgathers: the counts, then indices and values packed
    // by rank), and the sum is their concatenation coalesced, written into the caller's tensor.
    // Blocking (the Work is complete when returned): the gathered sizes decide the next call.
    c10::intrusive_ptr<c10d::Work> allreduce_sparse(at::Tensor& t,
                                                    const c10d::AllreduceOptions& opts) {
        TORCH_CHECK(t.device().is_cpu(), "libddp backend: allreduce takes CPU tensors, got one on ",
                    t.device());
        TORCH_CHECK(t.layout() == at::kSparse, "libddp backend: allreduce of a sparse tensor "
                    "takes the COO layout, got ", t.layout());
        auto o = static_cast<c10d::ReduceOp::RedOpType>(opts.reduceOp);
        TORCH_CHECK(o == c10d::ReduceOp::SUM, "libddp backend: allreduce of a sparse tensor "
                    "supports ReduceOp.SUM only, got ReduceOp.", op_name(o));
        std::vector<at::Tensor> outs{t};
        auto w = make_work(c10d::OpType::ALLREDUCE, "allreduce (sparse)", outs);
        int world = getSize();
        ddp_status_t s = DDP_OK;
        {
            at::NoGradGuard no_grad;
            at::Tensor in = t.coalesce();
            // Indices as [nnz, sparse_dim] rows, so that ranks' blocks concatenate.
            at::Tensor idx = in._indices().t().contiguous().to(at::kLong);
            at::Tensor val = in._values().contiguous();
            int64_t nnz = in._nnz();
            std::vector<int64_t> counts(world);
            // c10d calls backends with the GIL released; these block like any collective.
            s = ddp_group_allgather(group_, &nnz, counts.data(), 1, DDP_I64);
            if (s == DDP_OK) {
                int64_t total = 0;
                for (int64_t c : counts)
                    total += c;
                int64_t sparse_dim = in.sparse_dim();
                std::vector<int64_t> dense_sizes(val.sizes().begin() + 1, val.sizes().end());
                int64_t dense_numel = 1;
                for (int64_t d : dense_sizes)
                    dense_numel *= d;
                at::Tensor all_idx = at::empty({total, sparse_dim}, idx.options());
                std::vector<int64_t> vshape{total};
                vshape.insert(vshape.end(), dense_sizes.begin(), dense_sizes.end());
                at::Tensor all_val = at::empty(vshape, val.options());
                std::vector<size_t> ic(world), vc(world);
                for (int r = 0; r < world; r++) {
                    ic[r] = (size_t)(counts[r] * sparse_dim) * sizeof(int64_t);
                    vc[r] = (size_t)(counts[r] * dense_numel) * val.element_size();
                }
                s = ddp_group_allgatherv(group_, idx.data_ptr(), ic[getRank()], all_idx.data_ptr(),
                                         ic.data(), nullptr, DDP_U8);
                if (s == DDP_OK)
                    s = ddp_group_allgatherv(group_, val.data_ptr(), vc[getRank()],
                                             all_val.data_ptr(), vc.data(), nullptr, DDP_U8);
                if (s == DDP_OK) {
                    at::Tensor sum =
                        at::sparse_coo_tensor(all_idx.t(), all_val, in.sizes()).coalesce();
                    t.copy_(sum);
                }
            }
        }
        outstanding_.fetch_add(1);
        on_complete(new Completion{w, &outstanding_, group_}, s);
        return w;
    }

    // A send or recv. Inside a coalescing batch (torch >= 2: batch_isend_irecv) it waits for
    // endCoalescing, which issues the batch's messages in an order every rank agrees on; outside
    // one it is issued now (libddp: a collective of the two ranks, in issue order).
    c10::intrusive_ptr<c10d::Work> issue_p2p(const c10::intrusive_ptr<WorkDDP>& w,
                                             const at::Tensor& buf, int peer, int tag,
                                             bool is_send) {
#if LIBDDP_TORCH2
        if (coalescing_) {
            deferred_p2p_.push_back(DeferredP2P{w, buf, peer, tag, is_send});
            return w;
        }
#endif
        issue(*w, [&](ddp_work_t** h) {
            return is_send ? ddp_group_send_async(group_, buf.data_ptr(), bytes_of(buf), DDP_U8,
                                                  peer, tag, h)
                           : ddp_group_recv_async(group_, buf.data_ptr(), bytes_of(buf), DDP_U8,
                                                  peer, tag, h);
        });
        return launch(w);
    }

#if LIBDDP_TORCH2
    struct DeferredP2P {
        c10::intrusive_ptr<WorkDDP> work;
        at::Tensor buf;
        int peer;
        int tag;
        bool is_send;
    };

    // A batch promises that the order of its sends and recvs does not matter (torch's
    // batch_isend_irecv: [send to 1, recv from 1] on both ranks of a pair), but libddp matches a
    // pair's messages in issue order, so each rank issues them sorted: by peer, ascending (every
    // rank then meets its pairs in one global order, so no two wait on each other), and with
    // each peer the lower rank's sends before its recvs and the higher rank's recvs before its
    // sends, each kind in the order given (which the batch keeps significant).
    void issue_deferred_p2p() {
        std::vector<DeferredP2P> ops;
        ops.swap(deferred_p2p_);
        int me = getRank();
        std::stable_sort(ops.begin(), ops.end(), [me](const DeferredP2P& a, const DeferredP2P& b) {
            int pa = a.is_send == (me < a.peer) ? 0 : 1, pb = b.is_send == (me < b.peer) ? 0 : 1;
            return a.peer != b.peer ? a.peer < b.peer : pa < pb;
        });
        for (auto& op : ops) {
            issue(*op.work, [&](ddp_work_t** h) {
                return op.is_send ? ddp_group_send_async(group_, op.buf.data_ptr(),
                                                         bytes_of(op.buf), DDP_U8, op.peer,
                                                         op.tag, h)
                                  : ddp_group_recv_async(group_, op.buf.data_ptr(),
                                                         bytes_of(op.buf), DDP_U8, op.peer,
                                                         op.tag, h);
            });
            launch(op.work);
        }
    }
#endif

    static size_t bytes_of(const at::Tensor& t) {
        return (size_t)t.numel() * t.element_size();
    }

    static std::vector<at::Tensor> flat_views(const std::vector<at::Tensor>& ts) {
        std::vector<at::Tensor> v;
        v.reserve(ts.size());
        for (auto& t : ts)
            v.push_back(t.reshape({-1}));
        return v;
    }

    void check_root(const char* what, int64_t root) const {
        TORCH_CHECK(root >= 0 && root < getSize(), "libddp backend: ", what, ": root rank ", root,
                    " is outside the group of ", getSize(), " ranks");
    }

    static void check_same_dtype(const char* what, const at::Tensor& a, const at::Tensor& b) {
        TORCH_CHECK(a.scalar_type() == b.scalar_type(), "libddp backend: ", what,
                    ": tensors of different dtypes (", a.scalar_type(), " and ", b.scalar_type(),
                    ")");
    }

    void check_gather_list(const char* what, const std::vector<at::Tensor>& list,
                           const at::Tensor& one) const {
        TORCH_CHECK((int)list.size() == getSize(), "libddp backend: ", what, " takes a list of ",
                    getSize(), " tensors (one per rank), got ", list.size());
        for (auto& t : list) {
            check_cpu(what, t);
            check_same_dtype(what, t, one);
            TORCH_CHECK(t.numel() == one.numel(), "libddp backend: ", what,
                        ": every tensor of the "
                        "list must have ",
                        one.numel(), " elements, one has ", t.numel());
        }
    }

    c10::intrusive_ptr<WorkDDP> make_work(c10d::OpType type, const char* what,
                                          const std::vector<at::Tensor>& outputs) {
        TORCH_CHECK(group_, "libddp backend: ", what, " on rank ", getRank(),
                    ": the process group was shut down or aborted");
        std::string title = std::string("ddp:") + what;
        auto w = c10::make_intrusive<WorkDDP>(getRank(), type, title.c_str(), outputs);
        if (type != c10d::OpType::SEND && type != c10d::OpType::RECV &&
            type != c10d::OpType::RECVANYSOURCE && std::strcmp(what, "coalesced") != 0)
            sequence_number_.fetch_add(1);
        w->what_ = what;
        w->rank_in_group_ = getRank();
#if LIBDDP_TORCH2
        if (coalescing_)
            coalesced_.push_back(w);
#endif
        return w;
    }

    // The buffer libddp works on for `t` in place: t itself when contiguous (zero copy), else a
    // contiguous copy that is copied back on completion.
    static at::Tensor in_place_buffer(WorkDDP& w, const at::Tensor& t) {
        if (t.is_contiguous())
            return t;
        at::Tensor tmp = t.contiguous();
        w.keep_.push_back(tmp);
        auto prev = std::move(w.finish_);
        at::Tensor target = t;
        w.finish_ = [prev, target, tmp]() mutable {
            if (prev)
                prev();
            target.copy_(tmp);
        };
        return tmp;
    }

    void check_allgather_pair(const char* what, const at::Tensor& output,
                              const at::Tensor& input) const {
        check_cpu(what, output);
        check_cpu(what, input);
        check_same_dtype(what, input, output);
        TORCH_CHECK(output.numel() == input.numel() * getSize(), "libddp backend: ", what,
                    ": output has ", output.numel(), " elements, expected world size ", getSize(),
                    " x input's ", input.numel());
    }

    void check_reduce_scatter_pair(const char* what, const at::Tensor& output,
                                   const at::Tensor& input) const {
        check_cpu(what, output);
        check_cpu(what, input);
        check_same_dtype(what, input, output);
        TORCH_CHECK(input.numel() == output.numel() * getSize(), "libddp backend: ", what,
                    ": input has ", input.numel(), " elements, expected world size ", getSize(),
                    " x output's ", output.numel());
    }

    // allgather of `input` into `output` (in place when contiguous).
    void issue_allgather(WorkDDP& w, const at::Tensor& output, const at::Tensor& input) {
        at::Tensor in = input.contiguous();
        w.keep_.push_back(in);
        at::Tensor out = in_place_buffer(w, output);
        issue(w, [&](ddp_work_t** h) {
            return ddp_group_allgather_async(group_, in.data_ptr(), out.data_ptr(), bytes_of(in),
                                             DDP_U8, h);
        });
    }

    // reduce_scatter of `input` (world size x output's elements) into `output`; a PREMUL_SUM
    // scales a copy of the input, never the caller's tensor.
    void issue_reduce_scatter(WorkDDP& w, const at::Tensor& output, const at::Tensor& input,
                              const c10d::ReduceScatterOptions& opts) {
        ddp_dtype_t dt;
        ddp_reduce_op_t op;
        at::Tensor in = reduce_scatter_input(w, input, opts, &dt, &op);
        at::Tensor out = in_place_buffer(w, output);
        issue(w, [&](ddp_work_t** h) {
            return ddp_group_reduce_scatter_async(group_, in.data_ptr(), out.data_ptr(),
                                                  count_of(out), dt, op, h);
        });
    }

    // The contiguous input of a reduce_scatter, kept alive by the Work (a scaled copy for
    // PREMUL_SUM), and libddp's dtype and op for it.
    at::Tensor reduce_scatter_input(WorkDDP& w, const at::Tensor& input,
                                    const c10d::ReduceScatterOptions& opts, ddp_dtype_t* dt,
                                    ddp_reduce_op_t* op) {
        double premul;
        reduction_of(w.what_.c_str(), input, opts.reduceOp, dt, op, &premul);
        at::Tensor in = premul != 1.0 ? input * premul : input.contiguous();
        w.keep_.push_back(in);
        return in;
    }

    // allgather of `input` into a world-sized temporary; block j is copied out to outs[j].
    void issue_gather_into_temp(WorkDDP& w, const at::Tensor& input,
                                const std::vector<at::Tensor>& outs) {
        at::Tensor in = input.contiguous();
        at::Tensor all = at::empty({getSize() * in.numel()}, in.options());
        w.keep_.push_back(in);
        w.keep_.push_back(all);
        int64_t n = in.numel();
        auto prev = std::move(w.finish_);
        std::vector<at::Tensor> targets = outs;
        w.finish_ = [prev, all, targets, n]() mutable {
            if (prev)
                prev();
            for (size_t j = 0; j < targets.size(); j++)
                targets[j].copy_(all.narrow(0, (int64_t)j * n, n).view(targets[j].sizes()));
        };
        issue(w, [&](ddp_work_t** h) {
            return ddp_group_allgather_async(group_, in.data_ptr(), all.data_ptr(), bytes_of(in),
                                             DDP_U8, h);
        });
    }

    // Issues one libddp work through `start` and records its handle, or raises with libddp's
    // text. A libddp work of the same torch Work issued before still runs: its tensors stay alive
    // because this waits for it before raising.
    template <typename Start>
    void issue(WorkDDP& w, Start start) {
        // On the progress thread, inside a callback of this group's completion, an asynchronous
        // work would run only after the callback returns: a callback waiting for it (as the
        // PowerSGD hook waits for its allreduces) would hang. The ops with an inline path take
        // it there; the others are refused here rather than risk that hang.
        TORCH_CHECK(!in_completion(), "libddp backend: ", w.what_, " on rank ", getRank(),
                    " was issued from a callback of a completing Work of the same group (a comm "
                    "hook's then()), which runs on libddp's progress thread; there only "
                    "allreduce, allreduce_coalesced of one dtype, broadcast and barrier can run "
                    "(inline). Issue it from the training thread instead");
        ddp_work_t* h = nullptr;
        ddp_status_t s = start(&h);
        if (s != DDP_OK) {
            std::string text = ddp_last_error();
            for (ddp_work_t* prev : w.works_)
                ddp_work_wait(prev);
            TORCH_CHECK(false, "libddp backend: ", w.what_, " on rank ", getRank(),
                        " failed: ", ddp_status_string(s), ": ", text);
        }
        w.works_.push_back(h);
    }

    // Hands the Work to libddp's completion callback of its last libddp work.
    c10::intrusive_ptr<c10d::Work> launch(const c10::intrusive_ptr<WorkDDP>& w) {
        outstanding_.fetch_add(1);
        auto* c = new Completion{w, &outstanding_, group_};
        ddp_status_t s = ddp_work_on_complete(w->works_.back(), on_complete, c);
        if (s != DDP_OK) {
            outstanding_.fetch_sub(1);
            delete c;
            TORCH_CHECK(false, "libddp backend: ", w->what_, ": ", ddp_last_error());
        }
        return w;
    }

    // Small collectives when nothing of this group is in flight run inline: libddp's blocking
    // call executes on this thread (its fast path when the queue is empty), and the Work is
    // complete when returned. An async issue would cross two threads (issue -> progress thread ->
    // completion -> the waiting thread), which costs small tensors several times the collective
    // itself (docs/benchmarks.md, ddp/C column). Only small ones: the caller loses the overlap
    // of at most a short collective. Failures still surface on wait(), as for async works.
    static constexpr size_t kInlineMaxBytes = 64 * 1024;

    // Inline also at any size when the caller waits at once anyway (torch >= 2.7 says so with
    // asyncOp = false: dist.all_reduce(t) without async_op; older torch through libddp.torch's
    // wrappers, see caller_waits), and always inside a completion callback of this group (see
    // issue()).
    bool can_run_inline(size_t bytes, bool async) const {
        return in_completion() ||
               ((bytes <= kInlineMaxBytes || !async) && outstanding_.load() == 0);
    }

    // This thread runs a callback of one of this group's completing Works (see completing_group).
    bool in_completion() const { return completing_group == group_; }

    // The blocking call now, on this thread, when can_run_inline allows it; otherwise the
    // asynchronous one through the progress thread. Either way the Work torch gets back.
    template <typename Sync, typename Async>
    c10::intrusive_ptr<c10d::Work> run_or_issue(const c10::intrusive_ptr<WorkDDP>& w,
                                                size_t bytes, bool async, Sync sync,
                                                Async issue_async) {
        if (can_run_inline(bytes, async))
            return run_inline(w, sync);
        issue(*w, issue_async);
        return launch(w);
    }

    template <typename Run>
    c10::intrusive_ptr<c10d::Work> run_inline(const c10::intrusive_ptr<WorkDDP>& w, Run run) {
        ddp_status_t s = run();  // on failure ddp_last_error() holds the text on this thread
        inline_runs_.fetch_add(1, std::memory_order_relaxed);
        outstanding_.fetch_add(1);
        on_complete(new Completion{w, &outstanding_, group_}, s);
        return w;
    }

    ddp_store_t* store_ = nullptr;
    ddp_group_t* group_ = nullptr;
    std::mutex close_mu_;
    std::atomic<int> outstanding_{0};
    std::atomic<uint64_t> inline_runs_{0};      // collectives run on the issuing thread
    std::atomic<uint64_t> sequence_number_{0};  // collectives issued (getSequenceNumberForGroup)
    bool coalescing_ = false;  // between startCoalescing and endCoalescing (issuing thread only)
    std::vector<c10::intrusive_ptr<WorkDDP>> coalesced_;
#if LIBDDP_TORCH2
    std::vector<DeferredP2P> deferred_p2p_;  // a coalescing batch's sends and recvs
#endif
};

// set_caller_waits(waits) for libddp.torch's wrappers (see caller_waits).
static PyObject* set_caller_waits(PyObject*, PyObject* waits) {
    int v = PyObject_IsTrue(waits);
    if (v < 0) return nullptr;
    bool was = caller_waits;
    caller_waits = v != 0;
    return PyBool_FromLong(was);
}

static c10::intrusive_ptr<BackendBase> create(const c10::intrusive_ptr<c10d::Store>& store,
                                                     int rank, int size,
                                                     const std::chrono::duration<float>& timeout) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
    // Joining the group waits on the other ranks: let other Python threads run meanwhile.
    py::gil_scoped_release release;
    return c10::make_intrusive<ProcessGroupDDP>(store, rank, size, ms);
}

}  // namespace libddp_torch

PYBIND11_MODULE(_ddp_torch, m) {
    m.doc() = "libddp's torch.distributed backend (see libddp.torch)";
    py::class_<libddp_torch::ProcessGroupDDP, c10::intrusive_ptr<libddp_torch::ProcessGroupDDP>,
               libddp_torch::BackendBase>(m, "ProcessGroupDDP")
        .def_property_readonly("transport", &libddp_torch::ProcessGroupDDP::transport,
                               "The libddp transport this group runs on (shm, tcp, ...)")
        .def_property_readonly("timeout_ms", &libddp_torch::ProcessGroupDDP::timeoutMs)
        .def_property_readonly("inline_runs", &libddp_torch::ProcessGroupDDP::inlineRuns,
                               "How many collectives ran on the issuing thread (the blocking "
                               "ones and small ones), not through libddp's progress thread");
    m.def("create_process_group", &libddp_torch::create, py::arg("store"), py::arg("rank"),
          py::arg("size"), py::arg("timeout"),
          "Creates the backend's process group (the creator torch.distributed calls)");
    m.attr("torch_version") = TORCH_VERSION;
    // Whether torch's options tell the backend that the caller waits (asyncOp, torch >= 2.7).
    m.attr("options_have_async_op") = libddp_torch::has_async_op<c10d::AllreduceOptions>::value;
    // A plain CPython function rather than pybind11's: it runs twice per blocking call, and
    // pybind11's argument dispatch costs 5x the mark itself (~0.2 us against ~0.04).
    static PyMethodDef mark_def[] = {
        {"set_caller_waits", libddp_torch::set_caller_waits, METH_O,
         "set_caller_waits(waits: bool) -> bool\n\nMarks whether this thread's collectives are "
         "waited for at once (the blocking functions of torch < 2.7, wrapped by libddp.torch); "
         "returns the previous mark"},
        {nullptr, nullptr, 0, nullptr}};
    if (PyModule_AddFunctions(m.ptr(), mark_def) != 0) throw py::error_already_set();
}
