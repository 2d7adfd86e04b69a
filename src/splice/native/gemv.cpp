// splice's CPU GEMV kernels for decode (few rows of activations, weights streamed once from memory).
//
// Why they exist: torch's bf16 / int8 / int4 GEMVs stream each weight matrix without software prefetch (the hardware
// prefetcher stops at every 4 KiB page), so they read weights well below memory speed. These kernels read the weight
// with a software prefetch a few KiB ahead, and for one or two rows of x as two streams per thread (two far-apart
// parts of each thread's share side by side: for_spans, for_row_blocks), so decode runs at memory speed.
//
// All kernels: y[m, n] = sum_k x[m, k] * w[n, k] in float32, rounded once to bf16, for any number of rows
// of x, taken a few at a time against each block of weights (so the weights are read from memory once).
//   bf16_gemv(x bf16 [M, K], w bf16 [N, K])                       row-major weight, any N and K
//   int8_gemv(x bf16 [M, K], w int8 [N, K], scales bf16 [N])      per-output-channel scales
//   int8_dot_gemv(x, w, scales)  the same product with x rounded to int8 per row and block of 32 (W8A8): integer
//       dot products with AVX512-VNNI, else AVX-VNNI, else vpmaddubsw
//   Every int8 op also takes w as uint8 [N, K]: the same weight in int8 dword tiles (splice.native.int8_tile_pack;
//       K a multiple of 32), which int8_dot_gemv reads as they are with AVX512-VNNI and the others read back to rows
//   int8_dot_gemv_grouped(x, w int8 [N, K], scales bf16 [ceil(N / 16), K / group, 16])  int8_dot_gemv's arithmetic on
//       a weight with a scale per row and group of columns (whole blocks of 32): each block's sum times its group's
//       scale; the scales of 16 rows side by side per group (splice.native.int8_group_scales_pack)
//   int8_dot16_gemv(x, w, scales)  the same product with x rounded to int16 per row and block of 256: int8
//       weight-only's decode rows at the avx2 level without AVX-VNNI (vpmaddwd, the AVX2 code at every level)
//   int8_dot16_gemv_grouped(x, w, scales)  int8_dot_gemv_grouped's weight and scales on int8_dot16_gemv's rounding:
//       grouped int8's decode rows there, fastest on the weight in tiles (lanes are weight rows: no horizontal sums)
//   int4_gemv(x bf16 [M, K], w int32 [N/16, K/group, 2 * group + 16], group)
//       tiles of 16 rows, each tile its groups in column order, each group its chunks' words then its scales: word
//       (tile, g, 16c + r) holds q[16 tile + r, group g's columns 8c .. 8c+7] as nibbles in the order k =
//       0,2,4,6,1,3,5,7 (so k and k+1 sit 16 bits apart), and the group's last 16 words its rows' bf16 (scale, zero)
//       pairs (scale in the low half); value = (q - 8) * scale + zero per (row, group). A symmetric weight (every
//       zero 0) keeps its scales alone, 16 bf16 in 8 words: w int32 [N/16, K/group, 2 * group + 8], a tenth fewer
//       bytes to stream than the pairs. One stream holds a tile's weights and scales both, in the order the GEMVs
//       read them (splice.native.int4_tile_pack).
//   int4_dot_gemv(x, w, group)  the same with x rounded to int8 per row and block of 32, integer dot products
//       (AVX512-VNNI, else AVX-VNNI, else vpmaddubsw; groups of whole blocks); else int4_gemv
//   int4_dequantize(w, group) -> bf16 [N, K]
//       the same tiles back as a row-major bf16 weight, (q - 8) * scale + zero in float32 rounded once to bf16
//       (for prefill: one oneDNN GEMM on it beats the GEMV above once there are more than a few rows).
//   int8_linear(x, w, scales, widen), int4_linear(x, w, group, widen)  prefill: the weight de-quantised for one
//       bf16 GEMM, or with widen (a CPU without bf16 arithmetic) float32 GEMMs a slab of widened rows at a time
//   widened_linear(x, w bf16/fp16 [N, K])  prefill of a 16-bit weight as float32 GEMMs on widened slabs
// Also, at quantization time: gptq_columns, GPTQ's column-by-column rounding and error spreading in one block.
// And greedy decoding's pick: argmax_rows(x float32 or bf16 [B, V]) -> int64 [B], the indices torch.max(x, -1)
// returns; greedy_next, the pick with generate's eos and sequence bookkeeping.
//
// Instruction sets: the file is compiled for baseline x86-64; each kernel exists once per ISA level, in a region
// compiled for that level (#pragma GCC target), and the ops dispatch at run time on the active level:
//   ISA_AVX2    AVX2 + FMA: weights widened to float32 and multiply-added (8 lanes); int8 x int8 and int4 x int8
//               dot products with vpmaddubsw, or AVX-VNNI's 256-bit vpdpbusd where the CPU has it; int8 x int16
//               with vpmaddwd
//   ISA_AVX512  AVX-512 F/BW/VL/DQ + BF16: bf16 dot products (16 lanes, two products per lane and instruction)
//   ISA_AMX     ISA_AVX512, and AMX tiles for int4 (from 3 rows) and int8 (5-16 rows) GEMVs
// The active level starts at the best the CPU (and Linux, for AMX tile state) allows; set_isa lowers it, so every
// level the machine can execute can run and be tested here. Nothing outside the regions may use wider instructions.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// Before a kernel's loops over its registers' rows, tiles and chains: unrolled in full, their sums stay in registers
// (a loop GCC leaves rolled indexes them, so they live on the stack, a store and a load per step).
#define UNROLLED _Pragma("GCC unroll 16")

constexpr int64_t MAX_ROWS = 4;  // rows of x per pass over a block of weights (AVX-512)
constexpr int64_t PREFETCH_BYTES = 4096;
constexpr int TILE = 16;  // weight rows per int4 tile

// The kernels' software prefetch, PREFETCH_BYTES ahead in each weight stream, per kind of weight (PREFETCH_BF16,
// PREFETCH_INT8, PREFETCH_INT4) from a number of rows of x in one pass over the weights (set_software_prefetch_rows).
// Whether it helps depends on the CPU and on the kernel's arithmetic per byte: where the hardware prefetcher follows a
// sequential stream well on its own, the extra requests only take fill buffers from it; a kernel with more arithmetic
// per byte (more rows of x a pass) keeps fewer reads in flight by itself and gains from them.
enum PrefetchKind : int64_t { PREFETCH_BF16 = 1, PREFETCH_INT8 = 2, PREFETCH_INT4 = 4 };
constexpr int64_t PREFETCH_ALL = PREFETCH_BF16 | PREFETCH_INT8 | PREFETCH_INT4;
constexpr int PREFETCH_KIND_COUNT = 3;
// Per kind (in its bit's order), the rows of x a pass from which its kernels prefetch (0: never). Plain variables, set
// between kernel calls (native.use_software_prefetch): read inside a kernel's loop they stay in registers, where an
// atomic read would be made again on every step, and with it every pointer the loop reads.
int64_t software_prefetch_from[PREFETCH_KIND_COUNT] = {1, 1, 1};

constexpr int prefetch_index(int64_t kind) { return kind == PREFETCH_BF16 ? 0 : kind == PREFETCH_INT8 ? 1 : 2; }

// The kinds prefetched in every pass, as a mask.
int64_t software_prefetch() {
  int64_t kinds = 0;
  for (int i = 0; i < PREFETCH_KIND_COUNT; ++i)
    if (software_prefetch_from[i] == 1) kinds |= int64_t(1) << i;
  return kinds;
}

// Every pass for the kinds in the mask, none for the others.
void set_software_prefetch(int64_t kinds) {
  TORCH_CHECK(kinds >= 0 && kinds <= PREFETCH_ALL, "set_software_prefetch: ", kinds,
              " is not a mask of PREFETCH_BF16 (1), PREFETCH_INT8 (2) and PREFETCH_INT4 (4)");
  for (int i = 0; i < PREFETCH_KIND_COUNT; ++i) software_prefetch_from[i] = kinds >> i & 1;
}

std::vector<int64_t> software_prefetch_rows() {
  return {software_prefetch_from, software_prefetch_from + PREFETCH_KIND_COUNT};
}

// Per kind (bf16, int8, int4), the rows of x a pass from which its kernels prefetch; 0: never.
void set_software_prefetch_rows(at::IntArrayRef rows) {
  const bool counts = std::all_of(rows.begin(), rows.end(), [](int64_t r) { return r >= 0; });
  TORCH_CHECK(rows.size() == PREFETCH_KIND_COUNT && counts, "set_software_prefetch_rows: expected ",
              PREFETCH_KIND_COUNT, " row counts (bf16, int8, int4), each 0 (never) or more, got ", rows);
  std::copy(rows.begin(), rows.end(), software_prefetch_from);
}

// A software prefetch of the line at p into L1 (HINT _MM_HINT_T0) or L2 (_MM_HINT_T1), as inline assembly: GCC 12's
// dead-code elimination drops _mm_prefetch from some loops (the int8 kernels of two or more weight rows a pass, at
// both levels, compiled with none), and a prefetch the settings ask for must be issued. Where GCC keeps the
// intrinsic (bf16, int4) it stays: the assembly, a fixed point in GCC's scheduling, cost those kernels time.
template <int HINT>
inline void prefetch_line(const void* p) {
  static_assert(HINT == _MM_HINT_T0 || HINT == _MM_HINT_T1, "into L1 or L2");
  if constexpr (HINT == _MM_HINT_T0)
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  else
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
}

// A prefetch of a KIND weight's line at p by a pass over the weights with `rows` rows of x, into L1 (or HINT's level).
template <int64_t KIND, int HINT = _MM_HINT_T0>
inline void prefetch(const void* p, int64_t rows) {
  const int64_t from = software_prefetch_from[prefetch_index(KIND)];
  if (from <= 0 || rows < from) return;
  if constexpr (KIND == PREFETCH_INT8)
    prefetch_line<HINT>(p);
  else
    _mm_prefetch(static_cast<const char*>(p), static_cast<_mm_hint>(HINT));
}

// Keeps loaded values in registers: GCC otherwise folds each use of a loaded value into a memory operand of its own,
// loading it again for every weight row it meets, and a GEMV of one row of x is then bound by its loads.
template <typename T>
inline void keep_in_register(T& value) {
  asm("" : "+v"(value));
}

template <typename... T>
inline void keep_in_registers(T&... values) {
  (keep_in_register(values), ...);
}

// The prefetch kind of a row-major weight of element type T (bf16 or int8).
template <typename T>
constexpr int64_t prefetch_kind() {
  return std::is_same_v<T, at::BFloat16> ? PREFETCH_BF16 : PREFETCH_INT8;
}

// ---- instruction-set levels -----------------------------------------------------------------------------------------
enum Isa : int64_t { ISA_NONE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AMX = 3 };

bool cpu_has_amx_bf16() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 22 & 1) && (edx >> 24 & 1);  // AMX-BF16, -TILE
}

// Whether Linux lets this process use the AMX tile state (ARCH_REQ_XCOMP_PERM, Linux 5.16+). Asked once.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return cpu_has_amx_bf16() && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}

// The best level this CPU and OS run (__builtin_cpu_supports also checks that the OS saves the vector state).
int64_t best_isa() {
  static const int64_t best = [] {
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("avx512bf16");
    if (avx512) return int64_t(amx_permitted() ? ISA_AMX : ISA_AVX512);
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return int64_t(ISA_AVX2);
    return int64_t(ISA_NONE);
  }();
  return best;
}

std::atomic<int64_t> active_isa{-1};  // -1: not chosen yet (the best level)

// The settings a team's threads read (run_as_team, below): taken once when its region starts, so every thread takes
// the same paths through the kernels (and the same barriers) whatever changes them meanwhile.
struct TeamSettings {
  int64_t isa, weight_streams;
};
thread_local const TeamSettings* team_settings = nullptr;

int64_t isa() {
  if (team_settings) return team_settings->isa;
  int64_t level = active_isa.load(std::memory_order_relaxed);
  return level < 0 ? best_isa() : level;
}

void set_isa(int64_t level) {
  TORCH_CHECK(level >= ISA_AVX2 && level <= best_isa(), "set_isa: level ", level, " is not available; allowed: ",
              int64_t(ISA_AVX2), " (AVX2) to ", best_isa(), " on this CPU");
  active_isa.store(level, std::memory_order_relaxed);
}

bool amx_ready() { return isa() == ISA_AMX; }

void check_isa(const char* name) {
  TORCH_CHECK(isa() >= ISA_AVX2, name, ": this CPU lacks AVX2 and FMA, which splice's native kernels need");
}

// ---- checks -------------------------------------------------------------------------------------------------------
void check_rows(const at::Tensor& x, int64_t k, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, name, ": x must be [M, ", k, "], got ", x.sizes());
  TORCH_CHECK(x.size(0) >= 1, name, ": x has no rows");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu(), name,
              ": x must be a contiguous bf16 CPU tensor");
}

void check_bf16_weight(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.device().is_cpu(), name,
              ": w must be a contiguous bf16 CPU [N, K] tensor");
}

// An int8 weight [N, K]: int8 rows, or uint8 the same weight in int8 dword tiles (splice.native.int8_tile_pack; K
// whole blocks of 32).
void check_int8_weight(const at::Tensor& w, const char* name) {
  const bool tiles = w.scalar_type() == at::kByte;
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kChar || tiles) && w.is_contiguous() && w.device().is_cpu(),
              name, ": w must be a contiguous CPU [N, K] tensor, int8 or uint8 (tiles of "
              "splice.native.int8_tile_pack), got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(!tiles || w.size(1) % 32 == 0, name, ": int8 tiles need K a multiple of 32, got ", w.size(1));
}

void check_int8_scales(const at::Tensor& scales, int64_t n, const char* name) {
  TORCH_CHECK(scales.numel() == n && scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(), name,
              ": scales must be a contiguous bf16 tensor of ", n, " elements, got ", scales.scalar_type(), " ",
              scales.sizes());
}

// Words of one (tile, group) of an int4 weight: its chunks' (group / 8 of 16 words) and its 16 rows' scales (8 words of
// bf16 scales alone, 16 of (scale, zero) pairs).
constexpr int64_t int4_group_words(int64_t group, bool pairs) { return group * 2 + (pairs ? 16 : 8); }

void check_int4_tiles(const at::Tensor& w, int64_t group, const char* name) {
  TORCH_CHECK(group > 0 && group % 8 == 0, name, ": group ", group, " must be a positive multiple of 8");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kInt && w.is_contiguous() && w.device().is_cpu() &&
                  (w.size(2) == int4_group_words(group, true) || w.size(2) == int4_group_words(group, false)),
              name, ": w must be contiguous int32 CPU int4 tiles [N/16, K/", group, ", ",
              int4_group_words(group, true), "] (scale and zero pairs) or [N/16, K/", group, ", ",
              int4_group_words(group, false), "] (scales alone, zero 0) for group ", group, ", got ",
              w.scalar_type(), " ", w.sizes());
}

// An int4 weight in tiles (check_int4_tiles): per tile and group, the group's chunk words, then one 16-row line of
// bf16 (scale, zero) pairs, or of scales alone for a symmetric weight (every zero 0; half the bytes). Each level
// widens a line into its scale and zero vectors.
struct Int4Tiles {
  const int32_t* p;
  int64_t groups, group;  // per tile; columns per group
  bool pairs;
  int64_t stride;  // words per (tile, group)

  Int4Tiles(const at::Tensor& w, int64_t group)
      : p(w.data_ptr<int32_t>()), groups(w.size(1)), group(group), pairs(w.size(2) == int4_group_words(group, true)),
        stride(w.size(2)) {}
  int64_t k() const { return groups * group; }
  int64_t chunks_per_group() const { return group / 8; }
  // The words of group g's first chunk in a tile (its chunk i at + i * TILE).
  const int32_t* words(int64_t tile, int64_t g) const { return p + (tile * groups + g) * stride; }
  const at::BFloat16* line(int64_t tile, int64_t g) const {
    return reinterpret_cast<const at::BFloat16*>(words(tile, g) + group * 2);
  }
  float scale(int64_t tile, int64_t g, int r) const {
    return static_cast<float>(line(tile, g)[pairs ? 2 * r : r]);
  }
  float zero(int64_t tile, int64_t g, int r) const {
    return pairs ? static_cast<float>(line(tile, g)[2 * r + 1]) : 0.f;
  }
};

// ---- loops shared by every level ------------------------------------------------------------------------------------
template <int V>
using Int = std::integral_constant<int, V>;

// Weight streams per thread in the decode GEMVs. A core reading one sequential stream leaves the memory system idle
// between the hardware prefetcher's requests (software prefetch does not change that); streams far apart, each
// followed by the prefetcher on its own, keep more reads in flight. How many read fastest depends on the CPU
// (set_weight_streams; kernels that hold fewer streams' sums in their registers cap it: MAX_S below).
std::atomic<int64_t> weight_streams_setting{2};

int64_t weight_streams() {
  return team_settings ? team_settings->weight_streams : weight_streams_setting.load(std::memory_order_relaxed);
}

void set_weight_streams(int64_t streams) {
  TORCH_CHECK(streams == 1 || streams == 2 || streams == 4, "set_weight_streams: ", streams,
              " streams; allowed: 1, 2 or 4");
  weight_streams_setting.store(streams, std::memory_order_relaxed);
}

// Several streams for at most TWO_STREAM_ROWS rows of x: with more, the product is bound by arithmetic, not by the
// reads.
constexpr int64_t TWO_STREAM_ROWS = 2;

// g(Int<S>{}) for the streams a kernel of at most MAX_S streams walks for `rows` rows of x.
template <int MAX_S, typename G>
void with_streams(int64_t rows, int64_t stream_rows, G&& g) {  // several streams up to stream_rows rows
  const int64_t streams = rows <= stream_rows ? weight_streams() : 1;
  if constexpr (MAX_S >= 4) {
    if (streams >= 4) return g(Int<4>{});
  }
  if constexpr (MAX_S >= 2) {
    if (streams >= 2) return g(Int<2>{});
  }
  g(Int<1>{});
}

// A thread's tiles (or blocks of rows) [begin, end) as S spans walked side by side: f(Int<S>{}, t, span) computes
// tiles t, t + span, ..., t + (S - 1) * span together, f(Int<1>{}, t, 0) tile t alone (the tiles left over by a count
// that is not a multiple of S).
template <int S, typename F>
void for_spans(int64_t begin, int64_t end, F&& f) {
  int64_t t = begin;
  if constexpr (S > 1) {
    const int64_t span = (end - begin) / S;
    for (int64_t i = 0; i < span; ++i) f(Int<S>{}, begin + i, span);
    t = begin + S * span;
  }
  for (; t < end; ++t) f(Int<1>{}, t, int64_t{0});
}

// for_spans over [0, units) on every thread, each thread's share claimed in STEAL_PIECES pieces from a counter of its
// own: a thread done with its share claims the pieces left of the others'. With static shares alone one thread (one
// and the same, call after call) reads on alone at the end of every call while the others wait for it; the pieces keep
// each stream sequential except where a piece was taken. f as for_spans', with S = with_streams<MAX_S>(rows); every
// unit is computed exactly once, by whichever thread claims it, so results do not depend on who does.
constexpr int64_t STEAL_PIECES = 16;
std::atomic<bool> work_stealing_setting{true};  // set_work_stealing(false): static shares only (to compare)

bool work_stealing() { return work_stealing_setting.load(std::memory_order_relaxed); }
void set_work_stealing(bool on) { work_stealing_setting.store(on, std::memory_order_relaxed); }

struct alignas(64) StreamShare {
  std::atomic<int64_t> next{0};  // the first step not yet claimed
  int64_t begin = 0, span = 0, steps = 0, piece = 1;
};

// Thread t's share of `units` among `threads`, for S streams: step i < span computes units begin + i + j * span,
// j < S; the steps after, one unit at a time.
template <int S>
void set_share(StreamShare& share, int64_t units, int64_t t, int64_t threads) {
  share.begin = units * t / threads;
  const int64_t count = units * (t + 1) / threads - share.begin;
  share.span = S > 1 ? count / S : 0;
  share.steps = count - (S - 1) * share.span;
  share.piece = std::max<int64_t>(1, (share.steps + STEAL_PIECES - 1) / STEAL_PIECES);
  share.next.store(0, std::memory_order_relaxed);
}

// Claims pieces of `share` until none is left, computing each claimed step with f (as parallel_streams').
template <int S, typename F>
void claim_pieces(StreamShare& share, F& f) {
  for (int64_t i; (i = share.next.fetch_add(share.piece, std::memory_order_relaxed)) < share.steps;)
    for (int64_t step = i; step < std::min(i + share.piece, share.steps); ++step) {
      if (step < share.span)
        f(Int<S>{}, share.begin + step, share.span);
      else
        f(Int<1>{}, share.begin + (S - 1) * share.span + step, int64_t{0});
    }
}

// ---- a team: one parallel region's threads running a sequence of kernels (decode_layers') --------------------------
// A kernel called on its own opens a parallel region: its threads wake, and the work before and after its loop (x's
// rounding, a tail of rows) runs on the calling thread while the others wait, and they join at its end. A team
// (run_as_team) runs a whole sequence of kernels in one region instead: every thread calls each kernel in turn, a
// kernel's parallel loop (parallel_streams, parallel_units) gives each thread its share, the work before the loop runs
// on every thread into buffers of its own, the serial work after it on the team's leader (leads_team), and the
// team's caller puts a barrier (team_barrier) wherever one kernel's output feeds the next. Each thread sets a
// kernel's output to the same tensor (OutputInto).
struct TeamAborted {};  // thrown at a barrier once another thread of the team threw: every thread leaves the region

struct Team {
  int64_t size = 1;
  std::unique_ptr<StreamShare[]> shares;  // parallel_streams' shares, one a thread, set again by every call
  TeamSettings settings;
  std::atomic<int64_t> arrived{0}, generation{0};
  std::atomic<bool> failed{false};  // a thread threw

  void barrier() {
    if (failed.load(std::memory_order_relaxed)) throw TeamAborted{};
    const int64_t seen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == size - 1) {
      arrived.store(0, std::memory_order_relaxed);
      generation.store(seen + 1, std::memory_order_release);
      return;
    }
    // spin (a step's phases are microseconds apart); yield when the team has more threads than the CPU runs at once
    for (int64_t spins = 0; generation.load(std::memory_order_acquire) == seen; ++spins) {
      if (failed.load(std::memory_order_relaxed)) throw TeamAborted{};
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();
    }
  }
};

struct TeamSeat {
  Team* team = nullptr;
  int64_t rank = 0;
};
thread_local TeamSeat seat;

std::atomic<bool> layer_region_setting{true};  // set_layer_region(false): decode_layers' kernels open their own regions

bool layer_region() { return layer_region_setting.load(std::memory_order_relaxed); }
void set_layer_region(bool on) { layer_region_setting.store(on, std::memory_order_relaxed); }

bool leads_team() { return seat.team == nullptr || seat.rank == 0; }  // the thread that runs a kernel's serial work

void team_barrier() {
  if (seat.team) seat.team->barrier();
}

// Runs f on every thread of one parallel region as a team; or on this thread alone (each kernel then opening its own
// region) with one thread, inside another region, or with set_layer_region(false). f must take every thread through
// the same barriers. An exception on one thread stops the others at their next barrier, and is rethrown here once the
// region ends.
template <typename F>
void run_as_team(F&& f) {
  at::internal::lazy_init_num_threads();
  if (at::get_num_threads() <= 1 || at::in_parallel_region() || !layer_region()) return f();
  Team team;
  team.settings = TeamSettings{isa(), weight_streams()};
  std::exception_ptr error;
#pragma omp parallel
  {
#pragma omp single
    {  // the threads OpenMP gave (the single's end is a barrier)
      team.size = omp_get_num_threads();
      team.shares.reset(new StreamShare[team.size]);
    }
    const int64_t rank = omp_get_thread_num();
    at::internal::ThreadIdGuard thread_id(rank);
    c10::ParallelGuard in_region(true);
    seat = TeamSeat{&team, rank};
    team_settings = &team.settings;
    try {
      f();
    } catch (const TeamAborted&) {  // another thread threw first
    } catch (...) {
#pragma omp critical(splice_team_error)
      if (!error) error = std::current_exception();
      team.failed.store(true, std::memory_order_relaxed);
    }
    team_settings = nullptr;
    seat = TeamSeat{};
  }
  if (error) std::rethrow_exception(error);
}

// at::parallel_for(begin, end, grain, f), or in a team this thread's part of [begin, end) (the grain aside: the team's
// threads are awake already).
template <typename F>
void parallel_units(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (const Team* team = seat.team) {
    const int64_t n = end - begin;
    const int64_t first = begin + n * seat.rank / team->size, last = begin + n * (seat.rank + 1) / team->size;
    if (first < last) f(first, last);
    return;
  }
  at::parallel_for(begin, end, grain, f);
}

// parallel_streams with several streams a thread up to `stream_rows` rows of x (TWO_STREAM_ROWS by default).
template <int MAX_S = 2, typename F>
void parallel_streams(int64_t units, int64_t rows, int64_t stream_rows, F&& f) {
  with_streams<MAX_S>(rows, stream_rows, [&](auto s_c) {
    constexpr int S = decltype(s_c)::value;
    if (Team* team = seat.team) {  // its own share, then the others' pieces; the caller's barrier ends the kernel
      set_share<S>(team->shares[seat.rank], units, seat.rank, team->size);
      team->barrier();
      claim_pieces<S>(team->shares[seat.rank], f);
      if (work_stealing())
        for (int64_t other = 1; other < team->size; ++other)
          claim_pieces<S>(team->shares[(seat.rank + other) % team->size], f);
      return;
    }
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), units);
    if (threads <= 1 || at::in_parallel_region()) return for_spans<S>(0, units, f);
    std::unique_ptr<StreamShare[]> shares(new StreamShare[threads]);
    for (int64_t t = 0; t < threads; ++t) set_share<S>(shares[t], units, t, threads);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) claim_pieces<S>(shares[t], f);
      if (work_stealing())
        for (int64_t other = 1; other < threads; ++other) claim_pieces<S>(shares[(begin + other) % threads], f);
    });
  });
}

template <int MAX_S = 2, typename F>
void parallel_streams(int64_t units, int64_t rows, F&& f) {
  parallel_streams<MAX_S>(units, rows, TWO_STREAM_ROWS, f);
}

// A GEMV's output: a new tensor, or the one its caller set for it on this thread (OutputInto: decode_layers writes
// each layer's GEMVs into buffers it allocated once for all its layers).
thread_local const at::Tensor* next_output = nullptr;

at::Tensor kernel_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (const at::Tensor* out = std::exchange(next_output, nullptr)) {
    TORCH_CHECK(out->sizes() == sizes && out->is_contiguous() && out->dtype() == options.dtype(),
                "kernel_output: the output set is ", out->sizes(), ", the kernel's is ", sizes);
    return *out;
  }
  return at::empty(sizes, options);
}

// Sets the next GEMV's output on this thread, for the scope's lifetime.
struct OutputInto {
  explicit OutputInto(const at::Tensor& out) { next_output = &out; }
  ~OutputInto() { next_output = nullptr; }
  OutputInto(const OutputInto&) = delete;
  OutputInto& operator=(const OutputInto&) = delete;
};

template <int64_t X = 4, typename F>
void with_rows(int64_t m, F&& f) {  // calls f(Int<m>) for m in 1 .. X (only those are instantiated)
  if constexpr (X > 1) {
    if (m < X) return with_rows<X - 1>(m, f);
  }
  f(Int<X>{});
}

// Calls f(Int<rows of x>, first row of x) for chunks of up to X rows of x (the weights they share stay in cache
// between chunks).
template <int64_t X, typename F>
void for_x_chunks(int64_t m, F&& f) {
  for (int64_t m0 = 0; m0 < m; m0 += X) with_rows<X>(std::min(X, m - m0), [&](auto m_c) { f(m_c, m0); });
}

// The weight rows of one pass of a row-major GEMV: R / 4 blocks of four rows (or R < 4 rows), block i from row
// n0 + i * step.
struct RowBlock {
  int64_t n0, step;
  int64_t row(int r) const { return n0 + r / 4 * step + r % 4; }
};

// The first element of each row of a RowBlock of a row-major weight w [N, K].
template <int R, typename T>
void row_pointers(const T* w, int64_t k, RowBlock block, const T* row_at[R]) {
  for (int r = 0; r < R; ++r) row_at[r] = w + block.row(r) * k;
}

// The software prefetch of one STEP-column step of a row-major GEMV over the rows of a RowBlock, at column c (every
// level's kernels call these: prefetch is baseline SSE). Both fetch lines of the next block (the rows four on, which
// a thread's walk reads next), at the step's columns. bf16, 32 columns a step: a line per row, into L2: the line is
// read a whole pass over this block later, by when more than L1 holds has gone through it. int8: a row's step is
// STEP / 64 of a line, so R * STEP / 64 rows a step (one at least) get theirs, in the order they will be read.
template <int R, int STEP>
inline void prefetch_step(const at::BFloat16* const row_at[R], int64_t k, int64_t c, int64_t rows) {
  static_assert(STEP == 32, "a bf16 step is one line per row");
  for (int r = 0; r < R; ++r) prefetch<PREFETCH_BF16, _MM_HINT_T1>(row_at[r] + 4 * k + c, rows);
}

template <int R, int STEP>
inline void prefetch_step(const int8_t* const row_at[R], int64_t k, int64_t c, int64_t rows) {
  constexpr int lines = R * STEP / 64 > 1 ? R * STEP / 64 : 1;
  for (int i = 0; i < lines; ++i) prefetch<PREFETCH_INT8>(row_at[(lines * (c / STEP) + i) % R] + 4 * k + c, rows);
}

// Blocks of four weight rows split over the threads, f(Int<x rows>, Int<weight rows>, RowBlock, first x row) in chunks
// of X rows of x: with S > 1 weight streams (with_streams<MAX_S>: at most TWO_STREAM_ROWS rows of x)
// f(m, Int<4 S>{}, RowBlock{4b, 4 span}, m0) computes the thread's blocks b, b + span, ... together; the others (and
// every block otherwise) go four rows at a time, then the tail of n % 4 rows.
template <int64_t X, int MAX_S = 2, typename F>
void for_row_blocks(int64_t m, int64_t n, F&& f) {
  parallel_streams<MAX_S>(n / 4, m, [&](auto streams, int64_t b, int64_t span) {
    constexpr int S = decltype(streams)::value;
    if constexpr (S > 1) {
      for_x_chunks<TWO_STREAM_ROWS>(m, [&](auto m_c, int64_t m0) {
        f(m_c, Int<4 * S>{}, RowBlock{b * 4, span * 4}, m0);
      });
    } else {
      for_x_chunks<X>(m, [&](auto m_c, int64_t m0) { f(m_c, Int<4>{}, RowBlock{b * 4, 0}, m0); });
    }
  });
  const int64_t tail = n % 4;
  if (tail && leads_team())
    with_rows(tail, [&](auto r_c) {
      for_x_chunks<X>(m, [&](auto m_c, int64_t m0) { f(m_c, r_c, RowBlock{n - tail, 0}, m0); });
    });
}

// The S weight streams' rows of a RowBlock of 4 S (blocks of rows 0-3, 4-7, ...) as sets: f(the S row indices, their
// pointers) for row r of each block, r = 0 .. 3. A kernel that walks each set over every column before the next reads
// each stream's rows one after another, in sequence, where walking all 4 S rows at each step reads 4 S places at once,
// which is slower (docs/kernels.md).
template <int S, typename T, typename F>
void for_row_sets(const T* w, int64_t k, RowBlock block, F&& f) {
  for (int r = 0; r < 4; ++r) {
    int64_t rows[S];
    const T* row_at[S];
    for (int s = 0; s < S; ++s) {
      rows[s] = block.row(4 * s + r);
      row_at[s] = w + rows[s] * k;
    }
    f(rows, row_at);
  }
}

// ---- int8 activations for the int4 integer dot products (AVX-512 and AVX2 alike) ------------------------------------
// Both int4_dot_gemv kernels take x rounded to int8 per row and block of DOT_BLOCK columns (each level's round_rows,
// the same arithmetic: d = block's absolute max / 127, q = round(x / d) in -127..127), rearranged here once per call
// into the nibble order of the int4 tiles, so every level sums exactly the same integers.
constexpr int64_t DOT_BLOCK = 32;  // columns per activation scale (qmath.ACTIVATION_BLOCK)
constexpr int64_t DOT16_BLOCK = 256;  // columns per int16 activation scale (qmath.WIDE_ACTIVATION_BLOCK)

struct Int4DotActivations {
  std::vector<int32_t> pairs;  // [m, k / 8, 2]: per chunk the bytes of q at columns (0, 4, 1, 5) and (2, 6, 3, 7)
  std::vector<float> d;        // [m, k / 32]
  std::vector<float> sums;     // [m, k / group]: sum_b d_b * sum(q_b) over the group's blocks
  std::vector<int32_t> offsets;  // [m, k / 32]: -8 * sum(q_b), what a block's codes' offset of 8 adds to its dot
  int64_t blocks = 0, groups = 0, group = 0;  // a row's blocks and groups, and the group's columns

  // Sized for m rows of k columns in groups of `columns` (buffers kept from an earlier call reused), every sum 0.
  void resize(int64_t m, int64_t k, int64_t columns) {
    blocks = k / DOT_BLOCK, groups = k / columns, group = columns;
    pairs.resize(m * k / 4);
    d.resize(m * blocks);
    sums.assign(m * groups, 0.f);
    offsets.resize(m * blocks);
  }

  // Block b of row i: its scale and the sum of its int8 values. Each row's blocks come in column order, the order in
  // which every level's float sums add them.
  void add_block(int64_t i, int64_t b, float scale, int32_t sum) {
    d[i * blocks + b] = scale;
    sums[i * groups + b * DOT_BLOCK / group] += scale * static_cast<float>(sum);
    offsets[i * blocks + b] = -8 * sum;
  }
};

// The byte shuffle of four chunks of q (32 bytes) into the tiles' nibble order: per chunk of 8, columns (0, 4, 1, 5)
// then (2, 6, 3, 7).
__attribute__((target("avx2"))) inline __m256i nibble_order_shuffle() {
  return _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                          0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
}

// One row's q bytes in the tiles' nibble order (every level's CPU runs AVX2: one byte shuffle per 4 chunks).
__attribute__((target("avx2")))
void nibble_order(const int8_t* q, int64_t chunks, int32_t* pairs) {
  const __m256i order = nibble_order_shuffle();
  int64_t c = 0;
  for (; c + 4 <= chunks; c += 4)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + 2 * c),
                        _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 8 * c)), order));
  for (; c < chunks; ++c) {
    const int8_t* p = q + c * 8;
    const int8_t bytes[8] = {p[0], p[4], p[1], p[5], p[2], p[6], p[3], p[7]};
    std::memcpy(pairs + 2 * c, bytes, 8);
  }
}

// The sum of one block's DOT_BLOCK int8 values: bytes flipped to unsigned (+128) and summed against zero.
__attribute__((target("avx2")))
int32_t block_sum(const int8_t* q) {
  const __m256i flipped = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)),
                                           _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i sums = _mm256_sad_epu8(flipped, _mm256_setzero_si256());  // four 64-bit lanes
  const __m128i half = _mm_add_epi64(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  return static_cast<int32_t>(_mm_cvtsi128_si64(_mm_add_epi64(half, _mm_unpackhi_epi64(half, half)))) -
         128 * static_cast<int32_t>(DOT_BLOCK);
}

// x's rows rounded to int8 (q: [m, stride], k columns used; d: [m, k / 32] block scales) into a, for int4_dot_gemv.
void int4_dot_activations(const int8_t* q_rows, int64_t stride, const float* d, int64_t m, int64_t k, int64_t group,
                          Int4DotActivations& a) {
  static_assert(DOT_BLOCK == 32, "block_sum reads one 32-byte vector");
  a.resize(m, k, group);
  for (int64_t i = 0; i < m; ++i) {
    const int8_t* q = q_rows + i * stride;
    nibble_order(q, k / 8, a.pairs.data() + i * k / 4);
    for (int64_t b = 0; b < a.blocks; ++b) a.add_block(i, b, d[i * a.blocks + b], block_sum(q + b * DOT_BLOCK));
  }
}

// A grouped int8 weight's scales as every level's int8_dot_gemv_grouped reads them (splice.native.
// int8_group_scales_pack): bf16 [ceil(N / 16), groups, 16], each 16 rows' scales of one group side by side, so a
// walk over 16 rows reads its scales in sequence, as it reads the rows (in [groups, N] each group of 16 rows would be a
// line of its own, N apart from the next group's).
constexpr int64_t SCALE_TILE = 16;
struct GroupedScales {
  const at::BFloat16* s;
  int64_t group, tile_stride;  // columns per group; bf16 values per 16 rows' scales (groups * 16)
  std::vector<int64_t> lines;  // per block of DOT_BLOCK columns, where its group's 16 scales start in a tile

  GroupedScales(const at::Tensor& scales, int64_t k)
      : s(scales.data_ptr<at::BFloat16>()), group(k / scales.size(1)), tile_stride(scales.size(1) * SCALE_TILE),
        lines(k / DOT_BLOCK) {
    for (int64_t b = 0; b < k / DOT_BLOCK; ++b) lines[b] = b * DOT_BLOCK / group * SCALE_TILE;
  }
  // The 16 scales of rows first .. first + 15 (first a multiple of 16) for block b's group.
  const at::BFloat16* tile_line(int64_t first, int64_t block) const {
    return s + first / SCALE_TILE * tile_stride + lines[block];
  }
  const at::BFloat16* of(int64_t row, int64_t block) const {
    return tile_line(row - row % SCALE_TILE, block) + row % SCALE_TILE;
  }
  float at(int64_t row, int64_t block) const { return static_cast<float>(*of(row, block)); }
};
constexpr int64_t GROUPED_X_ROWS = 2;  // rows of x per pass of int8_dot_gemv_grouped (its scales take registers too)

// Each thread's x rounded for int4_dot_gemv (every level's), its buffers kept from call to call: in a team every thread
// rounds x for itself before each GEMV.
thread_local Int4DotActivations rounded_for_int4;

// What each level's int4_dot_blocks walks by block index (every group one block): T streams' tiles (first + t *
// step; block b's chunk words and then its scales' line at block(t, b)), and M rows of x from m0: row m's
// nibble-ordered pairs at x + m * chunks * 2, its block scales, sums and offsets at d, x_sums and offsets + m * blocks.
template <int T>
struct Int4BlockWalk {
  const int32_t* tiles[T];
  int64_t stride;  // words per block of a tile
  const int32_t* x;
  const float* d;
  const float* x_sums;
  const int32_t* offsets;

  Int4BlockWalk(const Int4DotActivations& a, int64_t m0, const Int4Tiles& w, int64_t first, int64_t step)
      : stride(w.stride), x(a.pairs.data() + m0 * (w.k() / 8) * 2), d(a.d.data() + m0 * (w.k() / DOT_BLOCK)),
        x_sums(a.sums.data() + m0 * (w.k() / DOT_BLOCK)), offsets(a.offsets.data() + m0 * (w.k() / DOT_BLOCK)) {
    for (int t = 0; t < T; ++t) tiles[t] = w.words(first + t * step, 0);
  }
  const int32_t* block(int t, int64_t b) const { return tiles[t] + b * stride; }
  const at::BFloat16* line(int t, int64_t b) const {
    return reinterpret_cast<const at::BFloat16*>(block(t, b) + 2 * DOT_BLOCK);
  }
  // Block b's chunk words in each stream.
  void blocks(int64_t b, const int32_t* (&words)[T]) const {
    for (int t = 0; t < T; ++t) words[t] = block(t, b);
  }
};

// ---- attention for one query per row (decode) ------------------------------------------------------------------
// decode_attention splits each row's keys into parts; one part of one row, for the query heads that share a KV head,
// is an AttentionPart, which each level's attend_part computes: the scores q . k * scale of the visible keys, their
// max m, p = e^(score - m), l = sum p and the unnormalised sum of p * v. The parts then merge exactly (flash
// decoding). Scores, exponentials and sums are float32 whatever T is.
template <typename T>
struct AttentionPart {
  const T* q;  // the group's first query head
  int64_t q_head_stride;
  const T* k;  // the part's first key and value
  const T* v;
  int64_t k_stride, v_stride;  // from one key (value) to the next
  const bool* visible;         // nullptr: every key is visible
  int64_t visible_stride;
  int64_t keys, dim, heads;    // keys in the part, head_dim, query heads in the group
  float scale;
  float* out;                  // [heads][dim + 2]: sum of p * v, then m, then l
};

constexpr int64_t MAX_HEAD_DIM = 256;
inline bool head_dim_fits(int64_t dim) { return dim % 16 == 0 && dim <= MAX_HEAD_DIM; }  // the attention's head sizes
constexpr float EXP_FLOOR = -87.3f;  // e^x of lower scores is taken as e^EXP_FLOOR (float's normal range ends there)

struct AttentionScratch {  // one thread's buffers, reused across parts
  std::vector<float> scores, q, keys, values;  // [heads][keys]; [heads][dim]; bf16 keys and values as float
  std::vector<uint32_t> seen;                  // per block of 16 keys, a bit per visible key
  std::vector<at::BFloat16> probabilities;     // [heads][keys rounded up to 32]: the weights of bf16 values, rounded
};

// The part's keys (or values) as float rows: fp32 ones where they are, bf16 ones widened into buffer (every head of
// the group reads each row, so it is widened once). Returns the first row; stride becomes the distance between rows.
template <typename T, typename Widen>
const float* rows_as_float(const T* rows, int64_t& stride, int64_t n, int64_t d, std::vector<float>& buffer,
                           Widen widen) {
  if constexpr (std::is_same_v<T, float>) {
    return rows;
  } else {
    buffer.resize(n * d);
    for (int64_t j = 0; j < n; ++j) widen(rows + j * stride, buffer.data() + j * d, d);
    stride = d;
    return buffer.data();
  }
}

// The float scores (and, at the avx2 level, the values) take the part's keys a block at a time, every head of the
// group reading a block before the next: a block's rows (widened where bf16) stay in the core's L1 cache for the
// heads, where the part's whole rows would be read from L2 by each head. A block holds KEY_BLOCK_FLOATS floats at
// most and a multiple of `lanes` keys.
constexpr int64_t KEY_BLOCK_FLOATS = 4096;

inline int64_t key_block(int64_t d, int64_t lanes) { return std::max(lanes, KEY_BLOCK_FLOATS / d / lanes * lanes); }

// Visibility bits of the part's keys, 16 to a block (bit i: key 16 * block + i is visible and exists).
inline void visible_bits(const bool* visible, int64_t stride, int64_t n,
                         std::vector<uint32_t>& seen) {
  seen.assign((n + 15) / 16, 0);
  for (int64_t j = 0; j < n; ++j)
    if (visible == nullptr || visible[j * stride]) seen[j / 16] |= 1u << (j % 16);
}

// The float operands both levels' attend_part compute on: the query heads, the keys and values (widened by the
// level's widen_row where bf16) and the visibility bits, in scratch; the scores buffer sized.
struct FloatPart {
  const float* q;  // [heads][dim]
  const float* keys;
  const float* values;
  int64_t k_stride, v_stride;
};

// The part's query heads as float rows [heads][dim] and its visibility bits, in scratch; the scores buffer sized.
template <typename T>
void part_queries(const AttentionPart<T>& a, AttentionScratch& scratch) {
  const int64_t d = a.dim;
  scratch.scores.resize(a.heads * a.keys);
  scratch.q.resize(a.heads * d);
  for (int64_t h = 0; h < a.heads; ++h)
    for (int64_t i = 0; i < d; ++i) scratch.q[h * d + i] = static_cast<float>(a.q[h * a.q_head_stride + i]);
  visible_bits(a.visible, a.visible_stride, a.keys, scratch.seen);
}

template <typename T, typename Widen>
FloatPart part_as_float(const AttentionPart<T>& a, AttentionScratch& scratch, Widen widen) {
  part_queries(a, scratch);
  FloatPart f{scratch.q.data(), nullptr, nullptr, a.k_stride, a.v_stride};
  f.keys = rows_as_float(a.k, f.k_stride, a.keys, a.dim, scratch.keys, widen);
  f.values = rows_as_float(a.v, f.v_stride, a.keys, a.dim, scratch.values, widen);
  return f;
}

template <typename F>
void with_vectors(int64_t vectors, F&& f) {  // f(Int<vectors>) for the head sizes models use, else f(Int<0>) (a loop)
  switch (vectors) {
    case 4: f(Int<4>{}); break;
    case 5: f(Int<5>{}); break;
    case 6: f(Int<6>{}); break;
    case 8: f(Int<8>{}); break;
    case 16: f(Int<16>{}); break;
    default: f(Int<0>{}); break;
  }
}

struct TileConfig {  // LDTILECFG's 64-byte operand, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
namespace avx512 {

inline __m512 bf16_to_f32(__m256i v) {  // 16 bf16 -> 16 float
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m512i load_bf16_pairs(const at::BFloat16* p, int64_t n) {  // n <= 32 bf16, zero-filled
  __mmask32 mask = n >= 32 ? ~__mmask32(0) : ((__mmask32(1) << n) - 1);
  return _mm512_maskz_loadu_epi16(mask, p);
}

// ---- AMX --------------------------------------------------------------------------------------------------------
// Tile matrix multiply (TDPBF16PS): sums[rows x 16] += a[rows x 32 bf16] . b[16 column pairs x 16 (bf16 pairs)], from
// tiles loaded from memory. The int4 and int8 GEMVs use it from AMX_MIN_ROWS and INT8_AMX_MIN_ROWS rows of x, where
// it beats one AVX-512 dot product per row (their sections measure it); at fewer rows the round trip of each
// converted weight slice through L1 costs more than it saves.
constexpr int64_t AMX_MIN_ROWS = 3, AMX_ROWS = 16, AMX_COLUMNS = 32;
// int4_dot_gemv's integer dot products stream a tile once per 2 or 4 rows of x and still beat the tiles up to 6 rows
// (docs/kernels.md has the measurements); from INT4_DOT_AMX_MIN_ROWS rows the tiles win.
constexpr int64_t INT4_DOT_AMX_MIN_ROWS = 7;

// Tile registers (GCC's _tile_* macros take them as literals): 0 = sums [rows x 16 float], 1 = x slice [rows x 32 bf16],
// 2 = weight slice [16 column pairs x 16 weight rows].

// ---- bf16 --------------------------------------------------------------------------------------------------------
// Four weight rows at a time; every 32 columns one 64-byte load per row and one dot-product instruction per x row.
template <int M, int R>
void bf16_rows(const at::BFloat16* x, const at::BFloat16* w, int64_t k, RowBlock block, at::BFloat16* out,
               int64_t n_total) {
  constexpr int m_rows = M, rows = R;
  __m512 acc[M][R];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const at::BFloat16* row_at[R];
  row_pointers<R>(w, k, block, row_at);
  for (int64_t c = 0; c < k; c += 32) {
    const int64_t left = k - c;
    prefetch_step<R, 32>(row_at, k, c, M);
    __m512i wv[R];
    UNROLLED for (int r = 0; r < rows; ++r) wv[r] = load_bf16_pairs(row_at[r] + c, left);
    UNROLLED for (int64_t m = 0; m < m_rows; ++m) {
      __m512bh xv = (__m512bh)load_bf16_pairs(x + m * k + c, left);
      UNROLLED for (int r = 0; r < rows; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, (__m512bh)wv[r]);
    }
  }
  UNROLLED for (int64_t m = 0; m < m_rows; ++m)
    UNROLLED for (int r = 0; r < rows; ++r)
      out[m * n_total + block.row(r)] = at::BFloat16(_mm512_reduce_add_ps(acc[m][r]));
}

// The S weight streams' rows as sets (for_row_sets), each stream prefetched in itself; each row's arithmetic is
// bf16_rows', so the outputs are the same bits.
template <int M, int S>
void bf16_row_sets(const at::BFloat16* x, const at::BFloat16* w, int64_t k, RowBlock block, at::BFloat16* out,
                   int64_t n_total) {
  for_row_sets<S>(w, k, block, [&](const int64_t rows[S], const at::BFloat16* const row_at[S]) {
    __m512 acc[M][S];
    UNROLLED for (int m = 0; m < M; ++m)
      UNROLLED for (int t = 0; t < S; ++t) acc[m][t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 32) {
      const int64_t left = k - c;
      __m512i wv[S];
      UNROLLED for (int t = 0; t < S; ++t) {
        prefetch<PREFETCH_BF16>(row_at[t] + c + PREFETCH_BYTES / 2, M);
        wv[t] = load_bf16_pairs(row_at[t] + c, left);
      }
      UNROLLED for (int64_t m = 0; m < M; ++m) {
        __m512bh xv = (__m512bh)load_bf16_pairs(x + m * k + c, left);
        UNROLLED for (int t = 0; t < S; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xv, (__m512bh)wv[t]);
      }
    }
    UNROLLED for (int64_t m = 0; m < M; ++m)
      UNROLLED for (int t = 0; t < S; ++t) out[m * n_total + rows[t]] = at::BFloat16(_mm512_reduce_add_ps(acc[m][t]));
  });
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  auto out = kernel_output({m, n}, x.options());
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = w.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  for_row_blocks<MAX_ROWS, 4>(m, n, [&](auto m_c, auto r_c, RowBlock rows, int64_t m0) {
    constexpr int R = decltype(r_c)::value;
    if constexpr (R > 4)
      bf16_row_sets<decltype(m_c)::value, R / 4>(xp + m0 * k, wp, k, rows, op + m0 * n, n);
    else
      bf16_rows<decltype(m_c)::value, R>(xp + m0 * k, wp, k, rows, op + m0 * n, n);
  });
  return out;
}

// ---- int8 ---------------------------------------------------------------------------------------------------------
// x is widened to float once; four weight rows at a time (eight: two blocks), 16 columns per step (sign-extend,
// convert, multiply-add).
template <int M, int R>
void int8_rows(const float* x, const int8_t* w, const at::BFloat16* scales, int64_t k, RowBlock block,
               at::BFloat16* out, int64_t n_total) {
  constexpr int m_rows = M, rows = R;
  __m512 acc[M][R];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int8_t* row_at[R];
  row_pointers<R>(w, k, block, row_at);
  for (int64_t c = 0; c < k; c += 16) {
    const int64_t left = k - c;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    prefetch_step<R, 16>(row_at, k, c, M);
    __m512 wv[R];
    UNROLLED for (int r = 0; r < rows; ++r)
      wv[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, row_at[r] + c)));
    UNROLLED for (int64_t m = 0; m < m_rows; ++m) {
      __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * k + c);
      UNROLLED for (int r = 0; r < rows; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  UNROLLED for (int64_t m = 0; m < m_rows; ++m)
    UNROLLED for (int r = 0; r < rows; ++r)
      out[m * n_total + block.row(r)] = at::BFloat16(_mm512_reduce_add_ps(acc[m][r]) *
                                                     static_cast<float>(scales[block.row(r)]));
}

// int8 on AMX, roles swapped: the weight is the a operand (16 weight rows x 32 columns: row-major int8 converted to
// bf16 as it streams is already that layout) and x the b operand (column pairs x rows of x, prepared once per call),
// so the sums tile is [16 weight rows x M] and each weight row gets its scale once, at the end. 64 columns per step:
// every row's cache line is converted whole (sign-extend, convert exactly to float, round to bf16: int8 fits bf16).
// AMX from INT8_AMX_MIN_ROWS rows, where it beats int8_rows (docs/kernels.md has the measurements): converting the
// weight to bf16 costs more than int4's decode, hence later than int4.
constexpr int64_t INT8_AMX_MIN_ROWS = 5;
__attribute__((target("amx-tile,amx-bf16")))
void int8_amx_blocks(const int32_t* x_pairs, int64_t m, const int8_t* w, const at::BFloat16* scales, int64_t n,
                     int64_t k, int64_t b_begin, int64_t b_end, at::BFloat16* out) {
  TileConfig config;
  config.rows[0] = config.rows[1] = config.rows[2] = 16;
  config.bytes_per_row[0] = config.bytes_per_row[2] = static_cast<uint16_t>(m * 4);
  config.bytes_per_row[1] = 64;
  _tile_loadconfig(&config);
  alignas(64) at::BFloat16 slices[2][16 * AMX_COLUMNS];
  alignas(64) float sums[16 * 16];
  for (int64_t block = b_begin; block < b_end; ++block) {
    const int64_t n0 = block * 16, rows = std::min<int64_t>(16, n - n0);
    const int8_t* base = w + n0 * k;
    _tile_zero(0);
    for (int64_t c = 0; c < k; c += 2 * AMX_COLUMNS) {
      const int64_t left = k - c;
      const __mmask64 mask = left >= 64 ? ~__mmask64(0) : ((__mmask64(1) << left) - 1);
      for (int64_t r = 0; r < 16; ++r) {
        __m512i bytes = _mm512_setzero_si512();
        if (r < rows) {
          prefetch<PREFETCH_INT8>(base + r * k + c + PREFETCH_BYTES / 8, m);
          bytes = _mm512_maskz_loadu_epi8(mask, base + r * k + c);
        }
        __m512 f[4];
        for (int j = 0; j < 4; ++j) f[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(bytes, j)));
        _mm512_store_si512(slices[0] + r * AMX_COLUMNS, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
        _mm512_store_si512(slices[1] + r * AMX_COLUMNS, (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]));
      }
      for (int half = 0; half < 2 && c + half * AMX_COLUMNS < k; ++half) {
        _tile_loadd(1, slices[half], 64);
        _tile_loadd(2, x_pairs + (c + half * AMX_COLUMNS) / 2 * m, m * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
    }
    _tile_stored(0, sums, 64);
    for (int64_t r = 0; r < rows; ++r) {
      const float scale = static_cast<float>(scales[n0 + r]);
      for (int64_t i = 0; i < m; ++i) out[i * n + n0 + r] = at::BFloat16(sums[r * 16 + i] * scale);
    }
  }
  _tile_release();
}

at::Tensor int8_amx(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  // b operand: x as (k, k + 1) pairs, one row per column pair and one column per row of x, columns padded with zeros
  // to whole 64-column steps
  const int64_t padded = (k + 2 * AMX_COLUMNS - 1) / (2 * AMX_COLUMNS) * (2 * AMX_COLUMNS);
  const at::Tensor x_pairs = at::constant_pad_nd(x, {0, padded - k}).view(at::kInt).t().contiguous();
  auto out = kernel_output({m, n}, x.options());
  const int32_t* xp = x_pairs.data_ptr<int32_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const auto* sp = scales.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  parallel_units(0, (n + 15) / 16, 1, [&](int64_t begin, int64_t end) {
    int8_amx_blocks(xp, m, wp, sp, n, k, begin, end, op);
  });
  return out;
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  if (m >= INT8_AMX_MIN_ROWS && m <= AMX_ROWS && amx_ready()) return int8_amx(x, w, scales);
  auto xf = x.to(at::kFloat).contiguous();
  auto out = kernel_output({m, n}, x.options());
  const float* xp = xf.data_ptr<float>();
  const auto* sp = scales.data_ptr<at::BFloat16>();
  const int8_t* wp = w.data_ptr<int8_t>();
  auto* op = out.data_ptr<at::BFloat16>();
  for_row_blocks<MAX_ROWS>(m, n, [&](auto m_c, auto r_c, RowBlock rows, int64_t m0) {
    int8_rows<decltype(m_c)::value, decltype(r_c)::value>(xp + m0 * k, wp, sp, k, rows, op + m0 * n, n);
  });
  return out;
}

// ---- int8 x int8 dot products (VNNI) ----------------------------------------------------------------------------
// W8A8 decode: x is rounded once per call to int8, one scale d per row and block of 32 columns (as
// qmath.round_activations: d = block's absolute max / 127, q = round(x / d) in -127..127), and each weight row is
// multiplied with integer dot products (vpdpbusd: 64 byte products per instruction, summed in int32), so the weight is
// never widened to float. vpdpbusd takes one unsigned operand: the weight bytes are flipped to w + 128 as they stream
// (one xor), which adds 128 * (the lane's four codes) to each int32 lane. That does not depend on the weight row, so
// its scaled sum over the row of x is worked out once per call (add_unflip) and taken off each output after the
// loop: y = scale * (sum_b d_b * flipped_b - sum_b d_b * 128 * codes_b). So a step reads only x's codes and scales
// beside the weights, not a third vector of the lanes' excesses to start each vpdpbusd from; each lane's int32 sum is
// still exact, its product with d rounded at the size of the flipped sum.
constexpr int64_t DOT_STEP = 64;   // columns per vpdpbusd (two blocks: 8 int32 lanes each)

struct DotActivations {
  int64_t padded;               // columns of q, k rounded up to DOT_STEP (zeros past k)
  std::vector<int8_t> q;        // [m, padded]
  std::vector<float> d;         // [m, padded / DOT_STEP, 16]: each lane's block scale (8 lanes per block)
  std::vector<float> unflip;    // [m]: what the flipped weights' excess takes off each row's sum (int8_dot_gemv's only)
};

// One block of DOT_BLOCK values of x at src rounded as qmath.round_activations: its scale d (returned: the block's
// absolute max / 127) and q = round(x / d) in -127..127 as 16 int32 lanes each of its first and second halves.
inline float round_block(const at::BFloat16* src, __m512i& q_lo, __m512i& q_hi) {
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
  const __m512 lo = bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512 hi = bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16)));
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  // a NaN in the block makes its scale NaN (max drops NaNs), so its products are NaN as qmath's are
  const bool nan = _mm512_cmp_ps_mask(lo, hi, _CMP_UNORD_Q) != 0;
  const float d = nan ? NAN : std::max(amax, 1e-12f) / 127.f;
  const __m512 dv = _mm512_set1_ps(d);
  q_lo = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_div_ps(lo, dv)), low), high);
  q_hi = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_div_ps(hi, dv)), low), high);
  return d;
}

DotActivations round_rows(const at::BFloat16* x, int64_t m, int64_t k) {
  DotActivations a;
  a.padded = (k + DOT_STEP - 1) / DOT_STEP * DOT_STEP;
  const int64_t steps = a.padded / DOT_STEP;
  a.q.assign(m * a.padded, 0);
  a.d.assign(m * steps * 16, 0.f);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < k / DOT_BLOCK; ++b) {
      __m512i q_lo, q_hi;
      const float d = round_block(x + i * k + b * DOT_BLOCK, q_lo, q_hi);
      int8_t* dst = a.q.data() + i * a.padded + b * DOT_BLOCK;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q_lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(q_hi));
      float* lanes = a.d.data() + (i * steps + b / 2) * 16 + (b % 2) * 8;
      std::fill(lanes, lanes + 8, d);
    }
  }
  return a;
}

// a.unflip from a.q and a.d: per row of x, the sum over its lanes of d * -128 * the lane's four codes (vpdpbusd of
// the bytes 128 with the codes gives 128 * each lane's four codes), in float64, then rounded once.
__attribute__((target("avx512vnni")))
void add_unflip(DotActivations& a, int64_t m) {
  const int64_t steps = a.padded / DOT_STEP;
  a.unflip.assign(m, 0.f);
  const __m512i bytes_128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < m; ++i) {
    __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
    for (int64_t s = i * steps; s < (i + 1) * steps; ++s) {
      const __m512i codes = _mm512_loadu_si512(a.q.data() + s * DOT_STEP);
      const __m512 excess = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), bytes_128, codes));
      const __m512 d = _mm512_loadu_ps(a.d.data() + s * 16);
      low = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(d)),
                            _mm512_cvtps_pd(_mm512_castps512_ps256(excess)), low);
      high = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(d, 1)),
                             _mm512_cvtps_pd(_mm512_extractf32x8_ps(excess, 1)), high);
    }
    a.unflip[i] = static_cast<float>(-_mm512_reduce_add_pd(_mm512_add_pd(low, high)));
  }
}

template <int M, int R, bool FLIPPED = false>  // FLIPPED: w's bytes stored as w + 128 (the tiles' tail rows)
__attribute__((target("avx512vnni")))
void int8_dot_rows(const DotActivations& a, int64_t m0, const int8_t* w, const at::BFloat16* scales, int64_t k,
                   RowBlock block, at::BFloat16* out, int64_t n_total) {
  constexpr int m_rows = M, rows = R;
  const int64_t steps = a.padded / DOT_STEP;
  const int8_t* xq = a.q.data() + m0 * a.padded;
  const float* xd = a.d.data() + m0 * steps * 16;
  __m512 acc[M][R];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int8_t* row_at[R];
  row_pointers<R>(w, k, block, row_at);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(FLIPPED ? 0 : 0x80));
  for (int64_t c = 0; c < k; c += DOT_STEP) {
    const int64_t left = k - c;
    const __mmask64 mask = left >= DOT_STEP ? ~__mmask64(0) : ((__mmask64(1) << left) - 1);
    prefetch_step<R, DOT_STEP>(row_at, k, c, M);
    __m512i wv[R];
    UNROLLED for (int r = 0; r < rows; ++r)
      wv[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, row_at[r] + c), flip);
    UNROLLED for (int m = 0; m < m_rows; ++m) {
      const __m512i xv = _mm512_loadu_si512(xq + m * a.padded + c);
      const __m512 dv = _mm512_loadu_ps(xd + (m * steps + c / DOT_STEP) * 16);
      UNROLLED for (int r = 0; r < rows; ++r)
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xv)), dv,
                                    acc[m][r]);
    }
  }
  UNROLLED for (int m = 0; m < m_rows; ++m)
    UNROLLED for (int r = 0; r < rows; ++r)
      out[m * n_total + block.row(r)] = at::BFloat16((_mm512_reduce_add_ps(acc[m][r]) + a.unflip[m0 + m]) *
                                                     static_cast<float>(scales[block.row(r)]));
}

// The S weight streams' rows as sets (for_row_sets), each set over every column, with a software prefetch
// PREFETCH_BYTES ahead in each stream. Each row's arithmetic is int8_dot_rows', so the outputs are the same bits. With
// one or two rows of x a step is a few vector instructions per weight row, so the loop keeps its bookkeeping out of
// them: whole steps unmasked (the masked tail once after them), x's codes and scales loaded once a step for every
// weight row.
template <int M, int S>
__attribute__((target("avx512vnni"), always_inline))
inline void int8_dot_set_steps(const int8_t* xq, int64_t x_stride, const float* xd, int64_t d_stride,
                               const int8_t* const row_at[S], int64_t first, int64_t last, __mmask64 mask,
                               __m512 acc[M][S]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* rows[S];
  UNROLLED for (int t = 0; t < S; ++t) rows[t] = row_at[t];
  for (int64_t s = first; s < last; ++s) {
    const int64_t c = s * DOT_STEP;
    __m512i wv[S];
    UNROLLED for (int t = 0; t < S; ++t) {
      prefetch<PREFETCH_INT8>(rows[t] + c + PREFETCH_BYTES, M);
      wv[t] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, rows[t] + c), flip);
    }
    UNROLLED for (int m = 0; m < M; ++m) {
      __m512i xv = _mm512_loadu_si512(xq + m * x_stride + c);
      __m512 dv = _mm512_loadu_ps(xd + m * d_stride + s * 16);
      keep_in_registers(xv, dv);
      UNROLLED for (int t = 0; t < S; ++t)
        acc[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[t], xv)), dv,
                                    acc[m][t]);
    }
  }
}

template <int M, int S>
__attribute__((target("avx512vnni")))
void int8_dot_row_sets(const DotActivations& a, int64_t m0, const int8_t* w, const at::BFloat16* scales, int64_t k,
                       RowBlock block, at::BFloat16* out, int64_t n_total) {
  const int64_t steps = a.padded / DOT_STEP, whole = k / DOT_STEP, x_stride = a.padded, d_stride = steps * 16;
  const int8_t* const xq = a.q.data() + m0 * a.padded;
  const float* const xd = a.d.data() + m0 * d_stride;
  const __mmask64 tail = (__mmask64(1) << (k - whole * DOT_STEP)) - 1;
  for_row_sets<S>(w, k, block, [&](const int64_t rows[S], const int8_t* const row_at[S]) {
    __m512 acc[M][S];
    UNROLLED for (int m = 0; m < M; ++m)
      UNROLLED for (int t = 0; t < S; ++t) acc[m][t] = _mm512_setzero_ps();
    int8_dot_set_steps<M, S>(xq, x_stride, xd, d_stride, row_at, 0, whole, ~__mmask64(0), acc);
    if (whole < steps) int8_dot_set_steps<M, S>(xq, x_stride, xd, d_stride, row_at, whole, steps, tail, acc);
    UNROLLED for (int m = 0; m < M; ++m)
      UNROLLED for (int t = 0; t < S; ++t)
        out[m * n_total + rows[t]] = at::BFloat16((_mm512_reduce_add_ps(acc[m][t]) + a.unflip[m0 + m]) *
                                                  static_cast<float>(scales[rows[t]]));
  });
}

// From TRANSPOSED_MIN_ROWS rows of x the kernels above are bound by their float work: every vpdpbusd's 16 lanes (four
// columns each) converted and scaled by their block's d, once per row of x. Here 16 weight rows at a time are
// transposed in registers, 64 columns a step (a 16 x 16 dword transpose, shared by every row of x), so each lane is
// one weight row: a block's eight vpdpbusd (x's dwords broadcast) sum its exact integer dot product per lane, which
// is converted and scaled once per block and row of x. Outputs: scale * sum_b d_b * dot_b, summed over the blocks in
// order (the same integers as the kernels above; their float sums differ only in rounding).
constexpr int64_t TRANSPOSED_MIN_ROWS = 3, TRANSPOSED_ROWS = 8;  // rows of x: from, and at most per pass
constexpr int64_t TRANSPOSED_WEIGHT_ROWS = 16;

// r[i] dword j -> r[j] dword i.
inline void transpose_dwords(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + c]'s 128-bit lane L: rows 4g .. 4g + 3 at dword 4L + c
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i even0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), odd0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i even1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i odd1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(even0, even1, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(even0, even1, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0xDD);
  }
}

// Per row of x and block: d and -128 * the sum of its codes (the flipped weights' excess, as a block's first term).
struct BlockTerms {
  std::vector<float> d;         // [m, k / DOT_BLOCK]
  std::vector<int32_t> unflip;  // [m, k / DOT_BLOCK]
};

BlockTerms block_terms(const DotActivations& a, int64_t m, int64_t k) {
  const int64_t blocks = k / DOT_BLOCK, steps = a.padded / DOT_STEP;
  BlockTerms terms{std::vector<float>(m * blocks), std::vector<int32_t>(m * blocks)};
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < blocks; ++b) {
      terms.d[i * blocks + b] = a.d[(i * steps + b / 2) * 16 + (b % 2) * 8];
      terms.unflip[i * blocks + b] = -128 * block_sum(a.q.data() + i * a.padded + b * DOT_BLOCK);
    }
  return terms;
}

// One block's integer dot products of 16 weight rows (lanes) with one row of x: eight broadcast dwords of x against
// the transposed vectors v[0..7], in CHAINS independent sums.
template <int CHAINS>
__attribute__((target("avx512vnni")))
inline __m512i block_dots(const __m512i* v, const int32_t* x_dwords, int32_t unflip) {
  __m512i sums[CHAINS];
  sums[0] = _mm512_set1_epi32(unflip);
  UNROLLED for (int h = 1; h < CHAINS; ++h) sums[h] = _mm512_setzero_si512();
  UNROLLED for (int j = 0; j < 8; ++j)
    sums[j % CHAINS] = _mm512_dpbusd_epi32(sums[j % CHAINS], v[j], _mm512_set1_epi32(x_dwords[j]));
  UNROLLED for (int h = 1; h < CHAINS; ++h) sums[0] = _mm512_add_epi32(sums[0], sums[h]);
  return sums[0];
}

template <int M>
__attribute__((target("avx512vnni")))
void int8_dot_transposed(const DotActivations& a, const BlockTerms& terms, int64_t m0, const int8_t* w,
                         const at::BFloat16* scales, int64_t k, int64_t n0, at::BFloat16* out, int64_t n_total) {
  constexpr int CHAINS = M < 6 ? 2 : 1;  // enough independent sums in flight for vpdpbusd's latency
  const int64_t blocks = k / DOT_BLOCK;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[M];
  UNROLLED for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += DOT_STEP) {
    const bool both = k - c >= DOT_STEP;  // else only the step's first block is in the row
    const __mmask64 mask = both ? ~__mmask64(0) : (__mmask64(1) << DOT_BLOCK) - 1;
    // the 16 rows are read 16 places at once: the next 16 rows are fetched ahead in order, 16 lines a step, into L2
    // (they are read a whole pass over these rows later, by when more than L1 holds has gone through it)
    const char* ahead = reinterpret_cast<const char*>(w + (n0 + 16) * k) + c / DOT_STEP * 16 * 64;
    for (int i = 0; i < 16; ++i) prefetch<PREFETCH_INT8, _MM_HINT_T1>(ahead + 64 * i, M);
    __m512i v[16];
    UNROLLED for (int r = 0; r < 16; ++r)
      v[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + (n0 + r) * k + c), flip);
    transpose_dwords(v);
    const int64_t b = c / DOT_BLOCK;
    UNROLLED for (int m = 0; m < M; ++m) {
      const auto* x_dwords = reinterpret_cast<const int32_t*>(a.q.data() + (m0 + m) * a.padded + c);
      const int64_t at = (m0 + m) * blocks + b;
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dots<CHAINS>(v, x_dwords, terms.unflip[at])),
                               _mm512_set1_ps(terms.d[at]), acc[m]);
      if (both)
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dots<CHAINS>(v + 8, x_dwords + 8, terms.unflip[at + 1])),
                                 _mm512_set1_ps(terms.d[at + 1]), acc[m]);
    }
  }
  const __m512 scale = bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + n0)));
  UNROLLED for (int m = 0; m < M; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n_total + n0),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[m], scale)));
}

// int8_dot_gemv from TRANSPOSED_MIN_ROWS rows of x: the transposed kernel over every 16 weight rows, chunks of up to
// TRANSPOSED_ROWS rows of x; the last n % 16 weight rows on int8_dot_rows.
void int8_dot_gemv_transposed(const DotActivations& a, int64_t m, const int8_t* w, const at::BFloat16* scales,
                              int64_t n, int64_t k, at::BFloat16* out) {
  const BlockTerms terms = block_terms(a, m, k);
  parallel_streams<1>(n / TRANSPOSED_WEIGHT_ROWS, m, [&](auto, int64_t unit, int64_t) {
    for_x_chunks<TRANSPOSED_ROWS>(m, [&](auto m_c, int64_t m0) {
      int8_dot_transposed<decltype(m_c)::value>(a, terms, m0, w, scales, k, unit * TRANSPOSED_WEIGHT_ROWS,
                                                out + m0 * n, n);
    });
  });
  if (!leads_team()) return;
  for (int64_t row = n / TRANSPOSED_WEIGHT_ROWS * TRANSPOSED_WEIGHT_ROWS; row < n; row += 4)
    with_rows(std::min<int64_t>(4, n - row), [&](auto r_c) {
      for_x_chunks<MAX_ROWS>(m, [&](auto m_c, int64_t m0) {
        int8_dot_rows<decltype(m_c)::value, decltype(r_c)::value>(a, m0, w, scales, k, RowBlock{row, 0},
                                                                  out + m0 * n, n);
      });
    });
}

// ---- int8 dword tiles -----------------------------------------------------------------------------------------------
// The transposed kernel's layout made once, when a layer is built (splice.native.int8_tile_pack; a uint8 tensor of
// the weight's shape [N, K] marks it): each 16 rows' 64-column step is stored as the 16 x 16 dword transpose
// int8_dot_transposed makes in registers (64 bytes j: dword j of rows 0 .. 15), its bytes flipped to w + 128
// (vpdpbusd's unsigned operand); a last step of 32 columns holds its 8 vectors. The rows past the last whole 16 stay
// row-major, flipped. A group of 16 rows is then read in sequence with no shuffles: only the loads, the dot products
// and one conversion and scaling per 16 weight rows, block and row of x, at every number of rows of x.
inline int64_t whole_tile_rows(int64_t n) { return n / TRANSPOSED_WEIGHT_ROWS * TRANSPOSED_WEIGHT_ROWS; }

// One block of DOT_BLOCK columns of 16 weight rows (the transposed vectors v[0..7]) with M rows of x, into acc: the
// eight dot products of every row of x are issued side by side, in CHAINS sums per row, so M * CHAINS independent
// sums cover vpdpbusd's latency (a row's chain after another's would leave the out-of-order window too few).
template <int M, int CHAINS>
__attribute__((target("avx512vnni"), always_inline))
inline void int8_dot_tile_block(const __m512i* v, const DotActivations& a, const BlockTerms& terms, int64_t m0,
                                int64_t column, int64_t at, int64_t blocks, __m512 acc[M]) {
  __m512i sums[M][CHAINS];
  UNROLLED for (int m = 0; m < M; ++m) {
    sums[m][0] = _mm512_set1_epi32(terms.unflip[(m0 + m) * blocks + at]);
    UNROLLED for (int h = 1; h < CHAINS; ++h) sums[m][h] = _mm512_setzero_si512();
  }
  const int8_t* x = a.q.data() + m0 * a.padded + column;
  // x's broadcast words are loaded again for each group: kept from one group's block to the next (GCC's choice where
  // a thread walks two groups) they fill the registers and the sums spill
  asm("" : "+r"(x));
  UNROLLED for (int j = 0; j < 8; ++j)
    UNROLLED for (int m = 0; m < M; ++m) {
      const int32_t dword = reinterpret_cast<const int32_t*>(x + m * a.padded)[j];
      sums[m][j % CHAINS] = _mm512_dpbusd_epi32(sums[m][j % CHAINS], v[j], _mm512_set1_epi32(dword));
    }
  UNROLLED for (int m = 0; m < M; ++m) {
    UNROLLED for (int h = 1; h < CHAINS; ++h) sums[m][0] = _mm512_add_epi32(sums[m][0], sums[m][h]);
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m][0]), _mm512_set1_ps(terms.d[(m0 + m) * blocks + at]),
                             acc[m]);
  }
}

// Block b of a group of 16 tiled weight rows (its eight vectors at `block`) with M rows of x, into acc. The same block
// of the stream's next group (16 k bytes on) is fetched into L2 as this one is read.
template <int M>
__attribute__((target("avx512vnni"), always_inline))
inline void int8_dot_tiled_block(const DotActivations& a, const BlockTerms& terms, int64_t m0, const uint8_t* block,
                                 int64_t b, int64_t k, __m512 acc[M]) {
  constexpr int CHAINS = M >= 6 ? 1 : M >= 3 ? 2 : 4;
  __m512i v[8];
  UNROLLED for (int j = 0; j < 8; ++j) {
    prefetch<PREFETCH_INT8, _MM_HINT_T1>(block + TRANSPOSED_WEIGHT_ROWS * k + 64 * j, M);
    v[j] = _mm512_loadu_si512(block + 64 * j);
  }
  int8_dot_tile_block<M, CHAINS>(v, a, terms, m0, b * DOT_BLOCK, b, k / DOT_BLOCK, acc);
}

// One step of int8_dot_tiles: BOTH blocks of 64 columns, or the first block alone (a last step of 32).
template <int M, bool BOTH>
__attribute__((target("avx512vnni"), always_inline))
inline void int8_dot_tile_step(const DotActivations& a, const BlockTerms& terms, int64_t m0, const uint8_t* step,
                               int64_t c, int64_t k, __m512 acc[M]) {
  UNROLLED for (int half = 0; half < (BOTH ? 2 : 1); ++half)
    int8_dot_tiled_block<M>(a, terms, m0, step + half * DOT_BLOCK * TRANSPOSED_WEIGHT_ROWS, c / DOT_BLOCK + half, k,
                            acc);
}

// M rows of x times the group of 16 weight rows from n0 into out (the outputs' columns n0 .. n0 + 15).
template <int M>
__attribute__((target("avx512vnni"), always_inline))
inline void store_tile_rows(const __m512 acc[M], const at::BFloat16* scales, int64_t n0, at::BFloat16* out,
                            int64_t n_total) {
  const __m512 scale = bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + n0)));
  UNROLLED for (int m = 0; m < M; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n_total + n0),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[m], scale)));
}

// M rows of x times S (1 or 2) groups of 16 weight rows, the second from row n0 + span: the groups' steps in turn,
// so S streams are read side by side.
template <int M, int S>
__attribute__((target("avx512vnni")))
void int8_dot_tiles(const DotActivations& a, const BlockTerms& terms, int64_t m0, const uint8_t* w,
                    const at::BFloat16* scales, int64_t k, int64_t n0, int64_t span, at::BFloat16* out,
                    int64_t n_total) {
  static_assert(S == 1 || S == 2, "one or two streams");
  const int64_t whole = k / DOT_STEP * DOT_STEP;
  const uint8_t* first = w + n0 * k;
  const uint8_t* second = w + (n0 + span) * k;
  __m512 acc[M], acc2[M];
  UNROLLED for (int m = 0; m < M; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < whole; c += DOT_STEP) {
    int8_dot_tile_step<M, true>(a, terms, m0, first + c * TRANSPOSED_WEIGHT_ROWS, c, k, acc);
    if constexpr (S == 2) int8_dot_tile_step<M, true>(a, terms, m0, second + c * TRANSPOSED_WEIGHT_ROWS, c, k, acc2);
  }
  if (whole < k) {
    int8_dot_tile_step<M, false>(a, terms, m0, first + whole * TRANSPOSED_WEIGHT_ROWS, whole, k, acc);
    if constexpr (S == 2)
      int8_dot_tile_step<M, false>(a, terms, m0, second + whole * TRANSPOSED_WEIGHT_ROWS, whole, k, acc2);
  }
  store_tile_rows<M>(acc, scales, n0, out, n_total);
  if constexpr (S == 2) store_tile_rows<M>(acc2, scales, n0 + span, out, n_total);
}

// Up to TILE_STREAM_ROWS rows of x, a thread reads two groups' tiles side by side (where weight_streams() is two or
// more): one sequential stream each leaves too few reads in flight.
constexpr int64_t TILE_STREAM_ROWS = 4;

// The whole 16-row groups of int8 tiles, each a unit of the threads' shares: f(Int<M>, Int<S>, first row, the second
// stream's rows further on, first row of x) for chunks of up to TRANSPOSED_ROWS rows of x (the unit stays in cache
// between chunks), S streams a thread up to TILE_STREAM_ROWS rows of x.
template <typename F>
void for_tile_units(int64_t n, int64_t m, F&& f) {
  parallel_streams<2>(n / TRANSPOSED_WEIGHT_ROWS, m, TILE_STREAM_ROWS, [&](auto streams, int64_t unit, int64_t span) {
    constexpr int S = decltype(streams)::value;
    for_x_chunks<TRANSPOSED_ROWS>(m, [&](auto m_c, int64_t m0) {
      if constexpr (S == 1 || decltype(m_c)::value <= TILE_STREAM_ROWS)
        f(m_c, Int<S>{}, unit * TRANSPOSED_WEIGHT_ROWS, span * TRANSPOSED_WEIGHT_ROWS, m0);
    });
  });
}

// int8_dot_gemv on tiles (for_tile_units); the row-major tail on int8_dot_rows.
void int8_dot_gemv_tiles(const DotActivations& a, int64_t m, const uint8_t* w, const at::BFloat16* scales, int64_t n,
                         int64_t k, at::BFloat16* out) {
  const BlockTerms terms = block_terms(a, m, k);
  for_tile_units(n, m, [&](auto m_c, auto s_c, int64_t n0, int64_t span, int64_t m0) {
    int8_dot_tiles<decltype(m_c)::value, decltype(s_c)::value>(a, terms, m0, w, scales, k, n0, span, out + m0 * n, n);
  });
  if (!leads_team()) return;
  const auto* rows = reinterpret_cast<const int8_t*>(w);
  for (int64_t row = whole_tile_rows(n); row < n; row += 4)
    with_rows(std::min<int64_t>(4, n - row), [&](auto r_c) {
      for_x_chunks<MAX_ROWS>(m, [&](auto m_c, int64_t m0) {
        int8_dot_rows<decltype(m_c)::value, decltype(r_c)::value, true>(a, m0, rows, scales, k, RowBlock{row, 0},
                                                                        out + m0 * n, n);
      });
    });
}

at::Tensor int8_dot_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  DotActivations a = round_rows(x.data_ptr<at::BFloat16>(), m, k);
  add_unflip(a, m);
  auto out = kernel_output({m, n}, x.options());
  const auto* sp = scales.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  if (w.scalar_type() == at::kByte) {
    int8_dot_gemv_tiles(a, m, w.data_ptr<uint8_t>(), sp, n, k, op);
    return out;
  }
  const int8_t* wp = w.data_ptr<int8_t>();
  if (m >= TRANSPOSED_MIN_ROWS) {
    int8_dot_gemv_transposed(a, m, wp, sp, n, k, op);
    return out;
  }
  for_row_blocks<MAX_ROWS, 4>(m, n, [&](auto m_c, auto r_c, RowBlock rows, int64_t m0) {
    constexpr int R = decltype(r_c)::value;
    if constexpr (R > 4)
      int8_dot_row_sets<decltype(m_c)::value, R / 4>(a, m0, wp, sp, k, rows, op + m0 * n, n);
    else
      int8_dot_rows<decltype(m_c)::value, R>(a, m0, wp, sp, k, rows, op + m0 * n, n);
  });
  return out;
}

// ---- int8 in groups: a bf16 scale per weight row and group of columns --------------------------------------------
// A grouped int8 weight (a scale per row and group of columns, GroupedScales; the group whole blocks of DOT_BLOCK) in
// tiles: int8_dot_grouped_tiles below. In rows (and the tiles' tail rows), multiplied as int8_dot_gemv multiplies a
// per-channel one, but each 64-column step's lanes are scaled by the weight row's scales of their blocks' groups, so
// the flipped bytes' excess cannot be taken off once per row of x at the end: it is taken off each step's lanes
// (lane_excess: d * 128 * the lane's four codes) before the group scale.

// Per row of x and 64-column step, the 16 lanes' excess of the flipped weight bytes, already times the lane's d.
__attribute__((target("avx512vnni")))
std::vector<float> lane_excess(const DotActivations& a, int64_t m) {
  const int64_t steps = a.padded / DOT_STEP;
  std::vector<float> excess(m * steps * 16);
  const __m512i bytes_128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t s = 0; s < m * steps; ++s) {
    const __m512i codes = _mm512_loadu_si512(a.q.data() + s * DOT_STEP);
    const __m512 lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), bytes_128, codes));
    _mm512_storeu_ps(excess.data() + s * 16, _mm512_mul_ps(lanes, _mm512_loadu_ps(a.d.data() + s * 16)));
  }
  return excess;
}

// A step's lane scales of one weight row: its first block's group scale in lanes 0-7, its second's in 8-15 (SPLIT:
// the group is an odd number of blocks, so a step may straddle two groups), else one scale for all 16.
template <bool SPLIT>
inline __m512 step_scales(const GroupedScales& gs, int64_t row, int64_t block, int64_t blocks) {
  const __m512 first = _mm512_set1_ps(gs.at(row, block));
  if constexpr (!SPLIT) return first;
  const float second = block + 1 < blocks ? gs.at(row, block + 1) : 0.f;  // past k: lanes of zeros
  return _mm512_insertf32x8(first, _mm256_set1_ps(second), 1);
}

// One 64-column step (the lanes of `mask`) of S weight rows for M rows of x: each lane's sum, less the flipped bytes'
// excess, times its block's d and its group's scale (scale[t]), into acc.
template <int M, int S, bool FLIPPED>
__attribute__((target("avx512vnni")))
inline void grouped_step(const int8_t* xq, const float* xd, const float* xe, int64_t x_stride, int64_t d_stride,
                         const int8_t* const (&row_at)[S], const __m512 (&scale)[S], int64_t c, __mmask64 mask,
                         __m512 (&acc)[M][S]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(FLIPPED ? 0 : 0x80));
  __m512i wv[S];
  UNROLLED for (int t = 0; t < S; ++t) {
    prefetch<PREFETCH_INT8>(row_at[t] + c + PREFETCH_BYTES, M);
    wv[t] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, row_at[t] + c), flip);
  }
  UNROLLED for (int m = 0; m < M; ++m) {
    const __m512i xv = _mm512_loadu_si512(xq + m * x_stride + c);
    const int64_t lanes = m * d_stride + c / DOT_STEP * 16;
    const __m512 dv = _mm512_loadu_ps(xd + lanes), ev = _mm512_loadu_ps(xe + lanes);
    UNROLLED for (int t = 0; t < S; ++t) {
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[t], xv));
      acc[m][t] = _mm512_fmadd_ps(_mm512_fmsub_ps(sums, dv, ev), scale[t], acc[m][t]);
    }
  }
}

// S weight rows (rows[t], at row_at[t]; FLIPPED: stored as w + 128, the tiles' tail rows) over every column, walked
// together, for M rows of x from m0: a group at a time where groups are whole steps, else (SPLIT) each step's lanes
// scaled by their own blocks' groups.
template <int M, int S, bool SPLIT, bool FLIPPED>
__attribute__((target("avx512vnni")))
void int8_dot_grouped_set(const DotActivations& a, const std::vector<float>& excess, int64_t m0,
                          const int64_t (&rows)[S], const int8_t* const (&row_at)[S], const GroupedScales& gs,
                          int64_t k, at::BFloat16* out, int64_t n_total) {
  const int64_t steps = a.padded / DOT_STEP, blocks = k / DOT_BLOCK, whole = k / DOT_STEP * DOT_STEP;
  const int64_t d_stride = steps * 16;
  const int8_t* xq = a.q.data() + m0 * a.padded;
  const float* xd = a.d.data() + m0 * d_stride;
  const float* xe = excess.data() + m0 * d_stride;
  __m512 acc[M][S], scale[S];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int t = 0; t < S; ++t) acc[m][t] = _mm512_setzero_ps();
  if constexpr (SPLIT) {
    for (int64_t c = 0; c < k; c += DOT_STEP) {
      UNROLLED for (int t = 0; t < S; ++t) scale[t] = step_scales<true>(gs, rows[t], c / DOT_BLOCK, blocks);
      const __mmask64 mask = c < whole ? ~__mmask64(0) : (__mmask64(1) << (k - c)) - 1;
      grouped_step<M, S, FLIPPED>(xq, xd, xe, a.padded, d_stride, row_at, scale, c, mask, acc);
    }
  } else {
    for (int64_t g = 0; g < k; g += gs.group) {  // every group whole steps
      UNROLLED for (int t = 0; t < S; ++t) scale[t] = step_scales<false>(gs, rows[t], g / DOT_BLOCK, blocks);
      for (int64_t c = g; c < g + gs.group; c += DOT_STEP)
        grouped_step<M, S, FLIPPED>(xq, xd, xe, a.padded, d_stride, row_at, scale, c, ~__mmask64(0), acc);
    }
  }
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int t = 0; t < S; ++t) out[m * n_total + rows[t]] = at::BFloat16(_mm512_reduce_add_ps(acc[m][t]));
}

// A RowBlock of R weight rows: up to four walked together, else as sets of R / 4 rows (for_row_sets: each set over
// every column before the next, so each stream is read in sequence).
template <int M, int R, bool SPLIT, bool FLIPPED = false>
void int8_dot_grouped_rows(const DotActivations& a, const std::vector<float>& excess, int64_t m0, const int8_t* w,
                           const GroupedScales& gs, int64_t k, RowBlock block, at::BFloat16* out, int64_t n_total) {
  if constexpr (R > 4) {
    for_row_sets<R / 4>(w, k, block, [&](const int64_t (&rows)[R / 4], const int8_t* const (&row_at)[R / 4]) {
      int8_dot_grouped_set<M, R / 4, SPLIT, FLIPPED>(a, excess, m0, rows, row_at, gs, k, out, n_total);
    });
  } else {
    int64_t rows[R];
    const int8_t* row_at[R];
    for (int r = 0; r < R; ++r) rows[r] = block.row(r), row_at[r] = w + rows[r] * k;
    int8_dot_grouped_set<M, R, SPLIT, FLIPPED>(a, excess, m0, rows, row_at, gs, k, out, n_total);
  }
}

// M rows of x times S groups of 16 weight rows in int8 tiles (int8_dot_tiles' layout; the second group from row
// n0 + span): per block the 16 rows' exact sums (int8_dot_tile_block) times the block's d into a group's sums, which
// at the group's end are multiplied by the 16 rows' scales of that group (GroupedScales::tile_line: 32 bytes).
template <int M, int S>
__attribute__((target("avx512vnni")))
void int8_dot_grouped_tiles(const DotActivations& a, const BlockTerms& terms, int64_t m0, const uint8_t* w,
                            const GroupedScales& gs, int64_t k, int64_t n0, int64_t span, at::BFloat16* out,
                            int64_t n_total) {
  constexpr int64_t BLOCK_BYTES = DOT_BLOCK * TRANSPOSED_WEIGHT_ROWS;  // a block of a group of 16 rows: 8 vectors
  const int64_t blocks = k / DOT_BLOCK, per_group = gs.group / DOT_BLOCK;
  int64_t first_row[S];
  const uint8_t* base[S];
  __m512 acc[S][M], group_sums[S][M];
  UNROLLED for (int t = 0; t < S; ++t) {
    first_row[t] = n0 + t * span;
    base[t] = w + first_row[t] * k;
    UNROLLED for (int m = 0; m < M; ++m) acc[t][m] = group_sums[t][m] = _mm512_setzero_ps();
  }
  for (int64_t b = 0, left = per_group; b < blocks; ++b) {
    UNROLLED for (int t = 0; t < S; ++t)
      int8_dot_tiled_block<M>(a, terms, m0, base[t] + b * BLOCK_BYTES, b, k, group_sums[t]);
    if (--left) continue;
    left = per_group;
    UNROLLED for (int t = 0; t < S; ++t) {
      const auto* line = reinterpret_cast<const __m256i*>(gs.tile_line(first_row[t], b));
      const __m512 scale = bf16_to_f32(_mm256_loadu_si256(line));
      UNROLLED for (int m = 0; m < M; ++m) {
        acc[t][m] = _mm512_fmadd_ps(group_sums[t][m], scale, acc[t][m]);
        group_sums[t][m] = _mm512_setzero_ps();
      }
    }
  }
  UNROLLED for (int t = 0; t < S; ++t)
    UNROLLED for (int m = 0; m < M; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n_total + first_row[t]),
                          (__m256i)_mm512_cvtneps_pbh(acc[t][m]));
}

// int8_dot_gemv_grouped on tiles (as int8_dot_gemv_tiles walks them); the row-major tail on the grouped row kernels.
void int8_dot_gemv_grouped_tiles(const DotActivations& a, int64_t m, const uint8_t* w, const GroupedScales& gs,
                                 int64_t n, int64_t k, at::BFloat16* out) {
  const BlockTerms terms = block_terms(a, m, k);
  for_tile_units(n, m, [&](auto m_c, auto s_c, int64_t n0, int64_t span, int64_t m0) {
    int8_dot_grouped_tiles<decltype(m_c)::value, decltype(s_c)::value>(a, terms, m0, w, gs, k, n0, span,
                                                                       out + m0 * n, n);
  });
  if (!leads_team() || whole_tile_rows(n) == n) return;
  const std::vector<float> excess = lane_excess(a, m);
  const auto* rows = reinterpret_cast<const int8_t*>(w);
  const bool split = gs.group % DOT_STEP != 0;
  for (int64_t row = whole_tile_rows(n); row < n; row += 4)
    with_rows(std::min<int64_t>(4, n - row), [&](auto r_c) {
      for_x_chunks<GROUPED_X_ROWS>(m, [&](auto m_c, int64_t m0) {
        constexpr int M = decltype(m_c)::value, R = decltype(r_c)::value;
        const RowBlock block{row, 0};
        if (split) int8_dot_grouped_rows<M, R, true, true>(a, excess, m0, rows, gs, k, block, out + m0 * n, n);
        else int8_dot_grouped_rows<M, R, false, true>(a, excess, m0, rows, gs, k, block, out + m0 * n, n);
      });
    });
}

at::Tensor int8_dot_gemv_grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  const GroupedScales gs(scales, k);
  const DotActivations a = round_rows(x.data_ptr<at::BFloat16>(), m, k);
  auto out = kernel_output({m, n}, x.options());
  auto* op = out.data_ptr<at::BFloat16>();
  if (w.scalar_type() == at::kByte) {
    int8_dot_gemv_grouped_tiles(a, m, w.data_ptr<uint8_t>(), gs, n, k, op);
    return out;
  }
  const std::vector<float> excess = lane_excess(a, m);
  const int8_t* wp = w.data_ptr<int8_t>();
  const bool split = gs.group % DOT_STEP != 0;  // a step may straddle two groups
  for_row_blocks<GROUPED_X_ROWS>(m, n, [&](auto m_c, auto r_c, RowBlock rows, int64_t m0) {
    constexpr int M = decltype(m_c)::value, R = decltype(r_c)::value;
    if (split) int8_dot_grouped_rows<M, R, true>(a, excess, m0, wp, gs, k, rows, op + m0 * n, n);
    else int8_dot_grouped_rows<M, R, false>(a, excess, m0, wp, gs, k, rows, op + m0 * n, n);
  });
  return out;
}

// ---- int8 -> bf16 -------------------------------------------------------------------------------------------------
// The int8 codes as a bf16 [N, K] weight (exact: every int8 value is a bf16), for prefill's one oneDNN GEMM; the
// per-channel scales are applied to its output (int8_linear below).
// 32 int8 codes as bf16 at dst, the lanes of `mask`.
inline void store_codes_as_bf16(__m256i codes, at::BFloat16* dst, __mmask32 mask = ~__mmask32(0)) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
  _mm512_mask_storeu_epi16(dst, mask, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

void int8_to_bf16_into(const int8_t* src, int64_t numel, at::BFloat16* dst) {
  at::parallel_for(0, numel, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += 32) {
      const int64_t left = end - i;
      const __mmask32 mask = left >= 32 ? ~__mmask32(0) : ((__mmask32(1) << left) - 1);
      store_codes_as_bf16(_mm256_maskz_loadu_epi8(mask, src + i), dst + i, mask);
    }
  });
}

// int8 tiles (int8_dot_tiles' layout) -> the bf16 rows [N, K] of the same codes, exact: each step's vectors
// transposed back to rows (transpose_dwords is its own inverse), unflipped and widened; the row-major tail unflipped.
void int8_tiles_to_bf16_into(const uint8_t* w, int64_t n, int64_t k, at::BFloat16* dst) {
  at::parallel_for(0, n / TRANSPOSED_WEIGHT_ROWS, 1, [&](int64_t begin, int64_t end) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t g = begin; g < end; ++g)
      for (int64_t c = 0; c < k; c += DOT_STEP) {
        const int64_t words = std::min<int64_t>(DOT_STEP, k - c) / 4;  // 16, or 8 in a last step of 32 columns
        const uint8_t* step = w + (g * k + c) * TRANSPOSED_WEIGHT_ROWS;
        __m512i v[16];
        for (int j = 0; j < 16; ++j) v[j] = j < words ? _mm512_loadu_si512(step + 64 * j) : _mm512_setzero_si512();
        transpose_dwords(v);
        for (int r = 0; r < 16; ++r) {
          const __m512i codes = _mm512_xor_si512(v[r], flip);
          at::BFloat16* row = dst + (g * TRANSPOSED_WEIGHT_ROWS + r) * k + c;
          store_codes_as_bf16(_mm512_castsi512_si256(codes), row);
          if (words == 16) store_codes_as_bf16(_mm512_extracti64x4_epi64(codes, 1), row + 32);
        }
      }
  });
  for (int64_t i = whole_tile_rows(n) * k; i < n * k; ++i)
    dst[i] = at::BFloat16(static_cast<float>(static_cast<int8_t>(w[i] ^ 0x80)));
}

// ---- int4 ---------------------------------------------------------------------------------------------------------
// Lanes are weight rows (16 per tile). A nibble q becomes the bf16 value 128 + q by OR-ing 0x4300 into it, so one
// AND/OR (ternary logic) turns 16 rows x 2 columns into bf16 pairs for one dot product with the broadcast pair
// (x[k], x[k+1]). Per group: y += scale * (dot - 136 * sum(x)) + zero * sum(x).

// The four bf16 pair vectors of one chunk word vector q: pairs[p] lane r = (128 + q[r, 8c + 2p], 128 + q[r, 8c + 2p + 1]).
// (A & B) | C with A = the word shifted so the pair's nibbles sit at bits 0-3 of each 16-bit half. Shifts by 8 are
// byte shifts of the 128-bit lanes (another execution port than the bit shifts; the bytes they pull in from the
// neighbouring word are masked off).
inline void int4_pairs(__m512i q, __m512i pairs[4]) {
  const __m512i nibble = _mm512_set1_epi32(0x000F000F), bf16_128 = _mm512_set1_epi32(0x43004300);
  const __m512i q8 = _mm512_bsrli_epi128(q, 1);
  pairs[0] = _mm512_ternarylogic_epi32(q, nibble, bf16_128, 0xEA);
  pairs[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(q, 4), nibble, bf16_128, 0xEA);
  pairs[2] = _mm512_ternarylogic_epi32(q8, nibble, bf16_128, 0xEA);
  pairs[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(q8, 4), nibble, bf16_128, 0xEA);
}

// Per row of x and group of columns: the sum of x over the group (float), for the (136 * scale - zero) * sum(x) term.
std::vector<float> group_sums(const at::BFloat16* x, int64_t m, int64_t k, int64_t group) {
  std::vector<float> sums(m * (k / group));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / group; ++g) {
      const at::BFloat16* p = x + r * k + g * group;
      __m512 s = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 16 <= group; j += 16) s = _mm512_add_ps(s, bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j))));
      float total = _mm512_reduce_add_ps(s);
      for (; j < group; ++j) total += static_cast<float>(p[j]);
      sums[r * (k / group) + g] = total;
    }
  return sums;
}

// (scale, zero) of a tile's 16 rows from one line of its scales (Int4Tiles::line): bf16 (scale, zero) pairs where
// PAIRS, else scales alone (zero 0).
template <bool PAIRS>
inline void line_scale_zero(const at::BFloat16* line, __m512& scale, __m512& zero) {
  if constexpr (PAIRS) {
    const __m512i s_z = _mm512_loadu_si512(line);
    scale = _mm512_castsi512_ps(_mm512_slli_epi32(s_z, 16));
    zero = _mm512_castsi512_ps(_mm512_and_si512(s_z, _mm512_set1_epi32(0xFFFF0000)));
  } else {
    scale = bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line)));
    zero = _mm512_setzero_ps();
  }
}

// (scale, zero) of a tile's 16 rows in one group.
inline void int4_scale_zero(const Int4Tiles& w, int64_t tile, int64_t g, __m512& scale, __m512& zero) {
  if (w.pairs) return line_scale_zero<true>(w.line(tile, g), scale, zero);
  line_scale_zero<false>(w.line(tile, g), scale, zero);
}

// (scale, zero - bias * scale) of a tile's 16 rows in one group: the factor of a dot product of codes offset by
// bias, and of the sum of x.
inline void int4_scale_offset(const Int4Tiles& w, int64_t tile, int64_t g, float bias, __m512& scale,
                              __m512& offset) {
  __m512 zero;
  int4_scale_zero(w, tile, g, scale, zero);
  offset = _mm512_fnmadd_ps(scale, _mm512_set1_ps(bias), zero);
}

template <int M>
void int4_tile(const at::BFloat16* x, const float* xsum, const Int4Tiles& w, int64_t tile, at::BFloat16* out,
               int64_t n_total) {
  constexpr int m_rows = M;
  const int64_t k = w.k(), groups = w.groups, chunks_per_group = w.chunks_per_group();
  __m512 acc[M];
  UNROLLED for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 dot[M][4];  // one accumulator per column pair: four independent dependency chains
    UNROLLED for (int m = 0; m < M; ++m)
      for (int p = 0; p < 4; ++p) dot[m][p] = _mm512_setzero_ps();
    const int32_t* words = w.words(tile, g);
    for (int64_t i = 0, c = g * chunks_per_group; i < chunks_per_group; ++i, ++c) {
      prefetch<PREFETCH_INT4>(reinterpret_cast<const char*>(words + i * TILE) + PREFETCH_BYTES, M);
      __m512i pairs[4];
      int4_pairs(_mm512_loadu_si512(words + i * TILE), pairs);
      UNROLLED for (int64_t m = 0; m < m_rows; ++m) {
        const int32_t* xpairs = reinterpret_cast<const int32_t*>(x + m * k + c * 8);
        for (int p = 0; p < 4; ++p)
          dot[m][p] = _mm512_dpbf16_ps(dot[m][p], (__m512bh)pairs[p], (__m512bh)_mm512_set1_epi32(xpairs[p]));
      }
    }
    __m512 scale, offset;
    int4_scale_offset(w, tile, g, 136.0f, scale, offset);
    UNROLLED for (int64_t m = 0; m < m_rows; ++m) {
      const __m512 dot_m = _mm512_add_ps(_mm512_add_ps(dot[m][0], dot[m][1]), _mm512_add_ps(dot[m][2], dot[m][3]));
      acc[m] = _mm512_fmadd_ps(dot_m, scale, acc[m]);
      acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[m * groups + g]), acc[m]);
    }
  }
  UNROLLED for (int64_t m = 0; m < m_rows; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n_total + tile * TILE), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

// ---- int4 on AMX (AMX_MIN_ROWS rows and more) -------------------------------------------------------------------
// Within a tile, the 32-column slices of a group decode (int4_pairs) into exactly AMX B tiles in VNNI layout: row
// 4 * chunk + p holds pairs p of that chunk, 16 weight rows x (k, k + 1). So per group the tile's slices are decoded
// once into a buffer in L1; then for every 16 rows of x, TDPBF16PS sums them against x's columns (the A tile, read
// from x in place), and the [rows x 16] float sums get the group's scale and offset as in int4_tile. The decoding is
// paid once for all rows, where int4_tile pays a dot product per row and column pair; at one or two rows the round
// trip of the decoded tiles through L1 makes it slower (docs/kernels.md has the measurements).
// Tiles [t_begin, t_end) for all m rows of x (x holds whole AMX_ROWS chunks of rows when m > AMX_ROWS: padded).
__attribute__((target("amx-tile,amx-bf16")))
void int4_amx_tiles(const at::BFloat16* x, int64_t m, const float* xsum, const Int4Tiles& w, int64_t t_begin,
                    int64_t t_end, at::BFloat16* out, int64_t n_total) {
  TileConfig config;
  config.rows[0] = config.rows[1] = static_cast<uint8_t>(std::min(m, AMX_ROWS));
  config.rows[2] = 16;
  for (int t = 0; t < 3; ++t) config.bytes_per_row[t] = 64;
  _tile_loadconfig(&config);
  const int64_t k = w.k(), group = w.group, groups = w.groups, slices = group / AMX_COLUMNS;
  // per-call scratch from ATen (64-byte aligned): the decoded slices of one group, and one accumulator per row of x
  const at::Tensor scratch = at::empty({(slices * 16 + m) * 64}, at::TensorOptions().dtype(at::kByte));
  __m512i* decoded = reinterpret_cast<__m512i*>(scratch.data_ptr<uint8_t>());
  __m512* acc = reinterpret_cast<__m512*>(decoded + slices * 16);
  alignas(64) float sums[AMX_ROWS * TILE];
  for (int64_t tile = t_begin; tile < t_end; ++tile) {
    for (int64_t r = 0; r < m; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const int32_t* words = w.words(tile, g);
      for (int64_t i = 0; i < slices * 4; ++i) {
        prefetch<PREFETCH_INT4>(reinterpret_cast<const char*>(words + i * TILE) + PREFETCH_BYTES, m);
        int4_pairs(_mm512_loadu_si512(words + i * TILE), &decoded[4 * i]);
      }
      __m512 scale, offset;
      int4_scale_offset(w, tile, g, 136.0f, scale, offset);
      for (int64_t m0 = 0; m0 < m; m0 += AMX_ROWS) {
        _tile_zero(0);
        for (int64_t s = 0; s < slices; ++s) {
          _tile_loadd(2, &decoded[16 * s], 64);
          _tile_loadd(1, x + m0 * k + g * group + s * AMX_COLUMNS, k * 2);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sums, 64);
        for (int64_t r = 0; r < std::min(AMX_ROWS, m - m0); ++r) {
          __m512& a = acc[m0 + r];
          a = _mm512_fmadd_ps(_mm512_load_ps(sums + r * TILE), scale, a);
          a = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[(m0 + r) * groups + g]), a);
        }
      }
    }
    for (int64_t r = 0; r < m; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * n_total + tile * TILE), (__m256i)_mm512_cvtneps_pbh(acc[r]));
  }
  _tile_release();
}

at::Tensor int4_amx(const at::Tensor& x, const at::Tensor& w, int64_t group) {
  const Int4Tiles wt(w, group);
  const int64_t tiles = w.size(0), k = wt.k(), m = x.size(0), n = tiles * TILE;
  at::Tensor rows = x;  // A tiles read AMX_ROWS rows of x at a time: pad the last chunk with zero rows
  if (m > AMX_ROWS && m % AMX_ROWS) rows = at::constant_pad_nd(x, {0, 0, 0, AMX_ROWS - m % AMX_ROWS});
  const auto* xp = rows.data_ptr<at::BFloat16>();
  const std::vector<float> xsum = group_sums(xp, m, k, group);
  auto out = kernel_output({m, n}, x.options());
  auto* op = out.data_ptr<at::BFloat16>();
  parallel_units(0, tiles, 1, [&](int64_t begin, int64_t end) {
    int4_amx_tiles(xp, m, xsum.data(), wt, begin, end, op, n);
  });
  return out;
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& w, int64_t group) {
  const Int4Tiles wt(w, group);
  const int64_t tiles = w.size(0), k = wt.k(), m = x.size(0), n = tiles * TILE;
  if (m >= AMX_MIN_ROWS && group % AMX_COLUMNS == 0 && amx_ready()) return int4_amx(x, w, group);
  const auto* xp = x.data_ptr<at::BFloat16>();
  const std::vector<float> xsum = group_sums(xp, m, k, group);
  auto out = kernel_output({m, n}, x.options());
  const float* sp = xsum.data();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t groups = wt.groups;
  parallel_units(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for_x_chunks<MAX_ROWS>(m, [&](auto m_c, int64_t m0) {
        int4_tile<decltype(m_c)::value>(xp + m0 * k, sp + m0 * groups, wt, t, op + m0 * n, n);
      });
  });
  return out;
}

// ---- int4 x int8 dot products (VNNI) ----------------------------------------------------------------------------
// Decode rows of x rounded to int8 per row and block of 32 (as int8_dot_gemv), times the int4 tiles with vpdpbusd:
// the nibbles are already unsigned, so a tile word masked with 0x0F0F0F0F gives each row's columns 0, 4, 1, 5 of the
// chunk as bytes and shifted by 4 its columns 2, 6, 3, 7 (the nibble order above), against x's bytes in the same order
// broadcast to the 16 rows. A block's int32 sum starts from -8 * sum(q_b), so it is the exact dot of the codes less 8
// with q_b, and gets the block's scale d; per group, y += scale * sum_b d_b * dot_b, and where the scales come with
// zeros, zero * sum_b d_b * sum(q_b).

// x's rows rounded for int4_dot_gemv into a, one pass a block: each block rounded as round_rows rounds it, its bytes
// stored straight in the tiles' nibble order (a block is four chunks: one shuffle), with its scale and sum, so a holds
// what int4_dot_activations makes of round_rows' rows.
void round_rows_for_int4(const at::BFloat16* x, int64_t m, int64_t k, int64_t group, Int4DotActivations& a) {
  a.resize(m, k, group);
  const __m256i order = nibble_order_shuffle();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < a.blocks; ++b) {
      __m512i q_lo, q_hi;
      const float d = round_block(x + i * k + b * DOT_BLOCK, q_lo, q_hi);
      const __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(q_lo)),
                                                    _mm512_cvtepi32_epi8(q_hi), 1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.pairs.data() + (i * a.blocks + b) * DOT_BLOCK / 4),
                          _mm256_shuffle_epi8(bytes, order));
      a.add_block(i, b, d, _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi)));
    }
}

constexpr int64_t INT4_DOT_ROWS = 8;  // rows of x per pass over a tile (one stream)

// A block's int32 sum from int4_block_sums' chains (block_sum above sums a block of int8 values): with two, the first
// holds the low nibbles' products and the second 16 times the high nibbles' (exact: every term a multiple of 16, at
// most 4 * 240 * 127 a vpdpbusd lane, four chunks a block); with one, both in place.
template <int CHAINS>
__attribute__((target("avx512f"))) inline __m512i chains_sum(const __m512i (&sums)[CHAINS]) {
  static_assert(CHAINS == 1 || CHAINS == 2, "chains alternate low and high nibbles");
  if constexpr (CHAINS == 1) return sums[0];
  else return _mm512_add_epi32(sums[0], _mm512_srai_epi32(sums[1], 4));
}

// Block b's int32 sums for M rows of x (row m's nibble-ordered pairs at x + m * row_stride, its block offsets at
// offsets + m * blocks) and T tiles (the block's chunk words in tile t at words[t]): sums[m][t] in CHAINS chains,
// independent so that enough vpdpbusd chains are in flight for its latency; the first starts from the block's offset,
// so chains_sum gives the exact sum of (code - 8) * q. With more than one chain, the high nibbles stay in place (16
// times their value) until then.
template <int M, int T, int CHAINS>
__attribute__((target("avx512vnni")))
inline void int4_block_sums(const int32_t* const (&words)[T], const int32_t* x, int64_t row_stride,
                            const int32_t* offsets, int64_t blocks, int64_t b, __m512i (&sums)[M][T][CHAINS]) {
  const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
  UNROLLED for (int m = 0; m < M; ++m) {
    const __m512i offset = _mm512_set1_epi32(offsets[m * blocks + b]);
    UNROLLED for (int t = 0; t < T; ++t)
      UNROLLED for (int h = 0; h < CHAINS; ++h) sums[m][t][h] = h ? _mm512_setzero_si512() : offset;
  }
  UNROLLED for (int i = 0; i < 4; ++i) {
    const int64_t c = b * 4 + i;
    UNROLLED for (int t = 0; t < T; ++t) {
      prefetch<PREFETCH_INT4>(reinterpret_cast<const char*>(words[t] + i * TILE) + PREFETCH_BYTES, M);
      __m512i chunk = _mm512_loadu_si512(words[t] + i * TILE);
      keep_in_registers(chunk);
      const __m512i low = _mm512_and_si512(chunk, nibbles);
      const __m512i high = CHAINS > 1 ? _mm512_andnot_si512(nibbles, chunk)
                                      : _mm512_and_si512(_mm512_srli_epi32(chunk, 4), nibbles);
      UNROLLED for (int m = 0; m < M; ++m) {
        const int32_t* xp = x + m * row_stride + c * 2;
        __m512i& low_sum = sums[m][t][(2 * i) % CHAINS];
        low_sum = _mm512_dpbusd_epi32(low_sum, low, _mm512_set1_epi32(xp[0]));
        __m512i& high_sum = sums[m][t][(2 * i + 1) % CHAINS];
        high_sum = _mm512_dpbusd_epi32(high_sum, high, _mm512_set1_epi32(xp[1]));
      }
    }
  }
}

// M rows of T tiles' 16 outputs (tiles first + t * step), rounded to bf16.
template <int M, int T>
inline void store_tiles(const __m512 (&acc)[M][T], at::BFloat16* out, int64_t n_total, int64_t first, int64_t step) {
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int t = 0; t < T; ++t)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n_total + (first + t * step) * TILE),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][t]));
}

// Independent int32 sums per row and tile of int4_block_sums: with few rows and tiles, low and high nibbles add into
// sums of their own (the high ones left in place: one instruction a load fewer, two more a block to join them). Four
// chains a row and tile, alternate chunks apart, ran slower at one row: a block's sums need no longer chains for
// vpdpbusd's latency, as the blocks themselves overlap.
template <int M, int T>
constexpr int INT4_CHAINS = M * T <= 4 ? 2 : 1;

// T tiles at once (T weight streams, for_spans): tile first + i * step for i < T.
template <int M, int T>
__attribute__((target("avx512vnni")))
void int4_dot_tiles(const Int4DotActivations& a, int64_t m0, const Int4Tiles& w, int64_t first, int64_t step,
                    at::BFloat16* out, int64_t n_total) {
  const int64_t k = w.k(), chunks = k / 8, groups = w.groups, blocks = k / DOT_BLOCK;
  const int64_t blocks_per_group = w.group / DOT_BLOCK;
  constexpr int CHAINS = INT4_CHAINS<M, T>;
  const int32_t* x = a.pairs.data() + m0 * chunks * 2;
  const int32_t* offsets = a.offsets.data() + m0 * blocks;
  __m512 acc[M][T];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int t = 0; t < T; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 dots[M][T];
    UNROLLED for (int m = 0; m < M; ++m)
      UNROLLED for (int t = 0; t < T; ++t) dots[m][t] = _mm512_setzero_ps();
    for (int64_t i = 0, b = g * blocks_per_group; i < blocks_per_group; ++i, ++b) {
      const int32_t* words[T];
      UNROLLED for (int t = 0; t < T; ++t) words[t] = w.words(first + t * step, g) + i * 4 * TILE;
      __m512i sums[M][T][CHAINS];
      int4_block_sums<M, T, CHAINS>(words, x, chunks * 2, offsets, blocks, b, sums);
      UNROLLED for (int m = 0; m < M; ++m) {
        const __m512 d = _mm512_set1_ps(a.d[(m0 + m) * blocks + b]);
        UNROLLED for (int t = 0; t < T; ++t) {
          const __m512i block = chains_sum<CHAINS>(sums[m][t]);
          dots[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block), d, dots[m][t]);
        }
      }
    }
    UNROLLED for (int t = 0; t < T; ++t) {
      __m512 scale, zero;
      int4_scale_zero(w, first + t * step, g, scale, zero);
      UNROLLED for (int m = 0; m < M; ++m) acc[m][t] = _mm512_fmadd_ps(dots[m][t], scale, acc[m][t]);
      if (w.pairs) {
        UNROLLED for (int m = 0; m < M; ++m)
          acc[m][t] = _mm512_fmadd_ps(zero, _mm512_set1_ps(a.sums[(m0 + m) * groups + g]), acc[m][t]);
      }
    }
  }
  store_tiles<M, T>(acc, out, n_total, first, step);
}

// int4_dot_tiles where every group is one block (group == DOT_BLOCK, the common g32): the same float steps in the same
// order, so the same bits, without the group loop around the block loop; each stream's weight and scales, and each
// row's x, are walked by the block index, and whether the scales come with zeros is fixed at compile time. Per block
// the scale handling is as long as the four chunks' products, so these few instructions are worth a loop of their own.
template <int M, int T, bool PAIRS>
__attribute__((target("avx512vnni")))
void int4_dot_blocks(const Int4DotActivations& a, int64_t m0, const Int4Tiles& w, int64_t first, int64_t step,
                     at::BFloat16* out, int64_t n_total) {
  const int64_t chunks = w.k() / 8, blocks = w.k() / DOT_BLOCK;
  constexpr int CHAINS = INT4_CHAINS<M, T>;
  const Int4BlockWalk<T> walk(a, m0, w, first, step);
  __m512 acc[M][T];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int t = 0; t < T; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int32_t* words[T];
    walk.blocks(b, words);
    __m512i sums[M][T][CHAINS];
    int4_block_sums<M, T, CHAINS>(words, walk.x, chunks * 2, walk.offsets, blocks, b, sums);
    UNROLLED for (int t = 0; t < T; ++t) {
      __m512 scale, zero;
      line_scale_zero<PAIRS>(walk.line(t, b), scale, zero);
      UNROLLED for (int m = 0; m < M; ++m) {
        const __m512 dots = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chains_sum<CHAINS>(sums[m][t])),
                                            _mm512_set1_ps(walk.d[m * blocks + b]), _mm512_setzero_ps());
        acc[m][t] = _mm512_fmadd_ps(dots, scale, acc[m][t]);
        if constexpr (PAIRS)
          acc[m][t] = _mm512_fmadd_ps(zero, _mm512_set1_ps(walk.x_sums[m * blocks + b]), acc[m][t]);
      }
    }
  }
  store_tiles<M, T>(acc, out, n_total, first, step);
}

at::Tensor int4_dot_gemv(const at::Tensor& x, const at::Tensor& w, int64_t group) {
  const Int4Tiles wt(w, group);
  const int64_t tiles = w.size(0), k = wt.k(), m = x.size(0), n = tiles * TILE;
  Int4DotActivations& a = rounded_for_int4;
  round_rows_for_int4(x.data_ptr<at::BFloat16>(), m, k, group, a);
  auto out = kernel_output({m, n}, x.options());
  auto* op = out.data_ptr<at::BFloat16>();
  parallel_streams<4>(tiles, m, [&](auto t_c, int64_t first, int64_t step) {
    constexpr int T = decltype(t_c)::value;
    // up to 8 rows of x per pass over a tile (its unpacked nibbles serve them all), fewer with more streams
    for_x_chunks<std::max<int64_t>(TWO_STREAM_ROWS, INT4_DOT_ROWS / T)>(m, [&](auto m_c, int64_t m0) {
      constexpr int M = decltype(m_c)::value;
      if (group != DOT_BLOCK) int4_dot_tiles<M, T>(a, m0, wt, first, step, op + m0 * n, n);
      else if (wt.pairs) int4_dot_blocks<M, T, true>(a, m0, wt, first, step, op + m0 * n, n);
      else int4_dot_blocks<M, T, false>(a, m0, wt, first, step, op + m0 * n, n);
    });
  });
  return out;
}

// ---- int4 -> bf16 ---------------------------------------------------------------------------------------------------
// Per (row, group) a 16-entry table holds the 16 possible outputs: (q - 8) * scale + zero in float32 (q - 8 has at
// most 4 significant bits and scale 8, so the product is exact and the sum is rounded once, as in
// qmath.dequantize_int4), rounded to nearest even to bf16 (cvtne2ps, as the GEMV's output). Then 32 columns of a row
// cost three shuffles: four tile words (4 chunks x 16 rows) are transposed 4 x 4 so each 128-bit lane holds one
// row's four words; vpermw spreads a row's 16-bit halves over the 32 columns (k even in the low half, odd in the
// high), vpsrlvw moves each column's nibble to the bottom, and vpermw looks it up in the table (duplicated in both
// halves, so the stray fifth index bit does not matter). Groups that are not a multiple of 32 columns finish with a
// per-lane-shift path (two words per 16 lanes).
inline __m512 int4_column_pair(const int32_t* words, int64_t c, int64_t r, __m512 scale, __m512 zero,
                               bool one_chunk = false) {  // 16 floats: columns 8c .. 8c + 15 of tile row r
  const __m512i shifts = _mm512_setr_epi32(0, 16, 4, 20, 8, 24, 12, 28, 0, 16, 4, 20, 8, 24, 12, 28);
  __m512i q = _mm512_set1_epi32(words[c * TILE + r]);
  if (!one_chunk) q = _mm512_mask_set1_epi32(q, 0xFF00, words[(c + 1) * TILE + r]);
  const __m512i v = _mm512_sub_epi32(_mm512_and_si512(_mm512_srlv_epi32(q, shifts), _mm512_set1_epi32(15)),
                                     _mm512_set1_epi32(8));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), scale, zero);
}

void int4_dequantize_tile(const Int4Tiles& w, int64_t tile, at::BFloat16* out) {  // out: the tile's first row
  const int64_t k = w.k(), groups = w.groups, chunks_per_group = w.chunks_per_group();
  const __m512 q_minus_8 = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m512i spread[4];  // row 4l + i of a transposed block: its words sit in dwords 4l .. 4l + 3 of T_i
  for (int l = 0; l < 4; ++l) {
    alignas(64) int16_t sel[32];
    for (int j = 0; j < 32; ++j) sel[j] = static_cast<int16_t>(8 * l + 2 * (j >> 3) + (j & 1));
    spread[l] = _mm512_load_si512(sel);
  }
  alignas(64) int16_t shift_values[32];
  for (int j = 0; j < 32; ++j) shift_values[j] = static_cast<int16_t>(4 * ((j & 7) >> 1));
  const __m512i shifts = _mm512_load_si512(shift_values);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 scale_v, zero_v;
    int4_scale_zero(w, tile, g, scale_v, zero_v);
    alignas(64) float scales[TILE], zeros[TILE];
    _mm512_store_ps(scales, scale_v);
    _mm512_store_ps(zeros, zero_v);
    __m512i table[TILE];
    for (int r = 0; r < TILE; ++r) {
      const __m512 values = _mm512_fmadd_ps(q_minus_8, _mm512_set1_ps(scales[r]), _mm512_set1_ps(zeros[r]));
      table[r] = (__m512i)_mm512_cvtne2ps_pbh(values, values);
    }
    const int32_t* words = w.words(tile, g);  // chunk i at words + i * TILE
    at::BFloat16* group_out = out + g * w.group;
    int64_t c = 0;
    for (; c + 4 <= chunks_per_group; c += 4) {  // 32 columns x 16 rows
      const int32_t* block = words + c * TILE;
      const __m512i a = _mm512_loadu_si512(block), b = _mm512_loadu_si512(block + TILE);
      const __m512i cc = _mm512_loadu_si512(block + 2 * TILE), d = _mm512_loadu_si512(block + 3 * TILE);
      const __m512i ab_lo = _mm512_unpacklo_epi32(a, b), ab_hi = _mm512_unpackhi_epi32(a, b);
      const __m512i cd_lo = _mm512_unpacklo_epi32(cc, d), cd_hi = _mm512_unpackhi_epi32(cc, d);
      const __m512i t[4] = {_mm512_unpacklo_epi64(ab_lo, cd_lo), _mm512_unpackhi_epi64(ab_lo, cd_lo),
                            _mm512_unpacklo_epi64(ab_hi, cd_hi), _mm512_unpackhi_epi64(ab_hi, cd_hi)};
      for (int r = 0; r < TILE; ++r) {
        const __m512i nibbles = _mm512_srlv_epi16(_mm512_permutexvar_epi16(spread[r >> 2], t[r & 3]), shifts);
        _mm512_storeu_si512(group_out + r * k + c * 8, _mm512_permutexvar_epi16(nibbles, table[r]));
      }
    }
    for (int r = 0; c < chunks_per_group && r < TILE; ++r) {  // 8 to 24 columns left: group not a multiple of 32
      const __m512 scale = _mm512_set1_ps(scales[r]), zero = _mm512_set1_ps(zeros[r]);
      at::BFloat16* row = group_out + r * k;
      int64_t left = c;
      for (; left + 2 <= chunks_per_group; left += 2)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + left * 8),
                            (__m256i)_mm512_cvtneps_pbh(int4_column_pair(words, left, r, scale, zero)));
      if (left < chunks_per_group)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + left * 8),
                         _mm256_castsi256_si128((__m256i)_mm512_cvtneps_pbh(
                             int4_column_pair(words, left, r, scale, zero, true))));
    }
  }
}

// Tiles first .. end - 1 into out (row-major bf16, from the first tile's first row).
void int4_dequantize_into(const at::Tensor& w, int64_t group, int64_t first, int64_t end, at::BFloat16* out) {
  const Int4Tiles wt(w, group);
  at::parallel_for(first, end, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t t = begin; t < stop; ++t) int4_dequantize_tile(wt, t, out + (t - first) * TILE * wt.k());
  });
}


// ---- attention for one query per row (decode) ------------------------------------------------------------------
inline __m512 load_f32x16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_f32x16(const at::BFloat16* p) {
  return bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x for softmax's shifted scores (x <= 0, -inf gives 0): 2^n e^r with |r| <= ln 2 / 2 and Cephes' degree-6
// polynomial for e^r (within 2 ulp of e^x).
inline __m512 exp_scores(__m512 x) {
  const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 masked = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
  return _mm512_maskz_mul_ps(~masked, y, _mm512_castsi512_ps(two_n));
}

// 16 scores from s (fewer at the end: the rest read as -inf), for the max and the exponentials.
inline __mmask16 score_lanes(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// dots[i] = q . keys[i] lane-wise (the vectors of 16 floats summed in order; dots past keys_here stay 0): the keys
// are the inner loop, so the KEYS multiply-add chains run side by side rather than one after another.
template <int KEYS>
inline void key_dots(const float* q, const float* keys, int64_t stride, int64_t keys_here, int64_t vectors,
                     __m512 (&dots)[KEYS]) {
  for (int i = 0; i < KEYS; ++i) dots[i] = _mm512_setzero_ps();
  if (keys_here == KEYS) {
    for (int64_t c = 0; c < vectors; ++c) {
      const __m512 qv = _mm512_loadu_ps(q + 16 * c);
      for (int i = 0; i < KEYS; ++i)
        dots[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys + i * stride + 16 * c), dots[i]);
    }
    return;
  }
  for (int64_t i = 0; i < keys_here; ++i)  // the last, partial block
    for (int64_t c = 0; c < vectors; ++c)
      dots[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(keys + i * stride + 16 * c), dots[i]);
}

// Lane i: the sum of v[i]'s lanes (a transposing tree of unpacks and shuffles: 45 instructions for 16 sums).
inline __m512 sum16(const __m512 (&v)[16]) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

inline void widen_row(const at::BFloat16* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(dst + i, load_f32x16(src + i));
}

// out[:d] = sum_j p[j] * values[j] (V vectors of 16 per row; V = 0: vectors given at run time).
template <int64_t V>
void weighted_values(const float* p, const float* values, int64_t stride, int64_t n, int64_t vectors, float* out) {
  const int64_t count = V > 0 ? V : vectors;
  __m512 acc[V > 0 ? V : MAX_HEAD_DIM / 16];
  for (int64_t c = 0; c < count; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] == 0.f) continue;
    const __m512 w = _mm512_set1_ps(p[j]);
    for (int64_t c = 0; c < count; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(values + j * stride + 16 * c), acc[c]);
  }
  for (int64_t c = 0; c < count; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

// ---- bf16 keys and values read where they are -------------------------------------------------------------------
// A bf16 part needs no widened copy of its keys and values: the scores are vdpbf16ps products of the bf16 query and
// keys (each pair of exact bf16 products summed in float32), and each value row is widened in registers as it is
// weighted, for HEADS of the group's heads at once (HEADS * V multiply-add chains side by side, the row widened once
// per HEADS heads). Softmax, sums and the merge stay float32.
constexpr int64_t MAX_DIM_CHUNKS = MAX_HEAD_DIM / 32;  // 32 bf16 of a row per vdpbf16ps

inline __mmask32 dim_lanes(int64_t left) { return left >= 32 ? ~__mmask32(0) : ((__mmask32(1) << left) - 1); }

inline __m512bh load_bf16_chunk(const at::BFloat16* p, __mmask32 lanes) {
  return (__m512bh)_mm512_maskz_loadu_epi16(lanes, p);
}

// dots[i] = the pairwise sums of q . keys[i] (dots past keys_here stay 0), the keys the inner loop.
template <int KEYS>
inline void key_dots_bf16(const __m512bh (&q)[MAX_DIM_CHUNKS], const at::BFloat16* keys, int64_t stride,
                          int64_t keys_here, int64_t d, __m512 (&dots)[KEYS]) {
  for (int i = 0; i < KEYS; ++i) dots[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    const __mmask32 lanes = dim_lanes(d - c);
    if (keys_here == KEYS) {
      for (int i = 0; i < KEYS; ++i)
        dots[i] = _mm512_dpbf16_ps(dots[i], q[c / 32], load_bf16_chunk(keys + i * stride + c, lanes));
    } else {
      for (int64_t i = 0; i < keys_here; ++i)
        dots[i] = _mm512_dpbf16_ps(dots[i], q[c / 32], load_bf16_chunk(keys + i * stride + c, lanes));
    }
  }
}

// Head h's softmax from its scores in s (-inf where not visible): s becomes e^(score - max), out[d] the max and
// out[d + 1] the sum.
template <typename T>
inline void finish_softmax(const AttentionPart<T>& a, int64_t h, float* s, __m512 top) {
  const int64_t d = a.dim, n = a.keys;
  const float m = _mm512_reduce_max_ps(top);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; m != -INFINITY && j < n; j += 16) {
    const __mmask16 lanes = score_lanes(n - j);
    const __m512 p = exp_scores(_mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes, s + j),
                                              _mm512_set1_ps(m)));
    _mm512_mask_storeu_ps(s + j, lanes, p);
    total = _mm512_add_ps(total, p);
  }
  if (m == -INFINITY) std::fill(s, s + n, 0.f);  // no visible key in this part: it adds nothing
  float* out = a.out + h * (d + 2);
  out[d] = m;
  out[d + 1] = _mm512_reduce_add_ps(total);
}

// One block of 16 keys' scores from their dot products: scaled where visible, -inf elsewhere, stored at s (as many as
// the part has left) and taken into the running max top.
template <typename T>
inline void keep_scores(const AttentionPart<T>& a, __mmask16 visible, __m512 dots, float* s, int64_t left,
                        __m512& top) {
  const __m512 scores = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), visible, dots, _mm512_set1_ps(a.scale));
  _mm512_mask_storeu_ps(s, score_lanes(left), scores);
  top = _mm512_max_ps(top, scores);
}

// One head's scores of the part's keys first .. end - 1 (first a multiple of 16), 16 keys at a time (dots_of(j0,
// keys_here, dots) the block's dot products; blocks with no visible key skipped), scaled and masked into its row s
// and its running max top (keep_scores).
template <typename T, typename Dots>
inline void scores_of_keys(const AttentionPart<T>& a, const uint32_t* seen, int64_t first, int64_t end, float* s,
                           __m512& top, Dots dots_of) {
  for (int64_t j0 = first; j0 < end; j0 += 16) {
    const __mmask16 visible = static_cast<__mmask16>(seen[j0 / 16]);
    __m512 dots[16];
    if (visible) dots_of(j0, std::min<int64_t>(16, a.keys - j0), dots);
    keep_scores(a, visible, visible ? sum16(dots) : _mm512_setzero_ps(), s + j0, a.keys - j0, top);
  }
}

// Head h's scores of every key (scores_of_keys), then finish_softmax.
template <typename T, typename Dots>
inline void softmax_scores(const AttentionPart<T>& a, const uint32_t* seen, int64_t h, float* s, Dots dots_of) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  scores_of_keys(a, seen, 0, a.keys, s, top, dots_of);
  finish_softmax(a, h, s, top);
}

// Head h's softmax from bf16 query and keys read where they are (vdpbf16ps).
inline void softmax_scores_bf16(const AttentionPart<at::BFloat16>& a, const uint32_t* seen, int64_t h, float* s) {
  const int64_t d = a.dim;
  __m512bh q[MAX_DIM_CHUNKS];
  for (int64_t c = 0; c < d; c += 32) q[c / 32] = load_bf16_chunk(a.q + h * a.q_head_stride + c, dim_lanes(d - c));
  softmax_scores(a, seen, h, s, [&](int64_t j0, int64_t keys_here, __m512 (&dots)[16]) {
    key_dots_bf16<16>(q, a.k + j0 * a.k_stride, a.k_stride, keys_here, d, dots);
  });
}

// The query's bf16 pair at p (two columns) as one dword, to broadcast.
inline int32_t bf16_pair(const at::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return pair;
}

// Heads h0 .. h0 + H - 1's softmaxes from bf16 query and keys, the keys in lanes: per block of 16 keys and 32 columns,
// the keys' column pairs (dwords) are transposed in registers (transpose_dwords) so that kt[c] holds pair c of the 16
// keys, and each head's vdpbf16ps with its own pair c broadcast adds that pair's products to its 16 keys' dots. The
// transposition is shared by the H heads, and no sum across lanes is left to do (softmax_scores_bf16 sums 16 vectors
// per block and head).
template <int H>
void softmax_scores_bf16_heads(const AttentionPart<at::BFloat16>& a, const uint32_t* seen, int64_t h0, float* p) {
  const int64_t n = a.keys, pairs = a.dim / 2;
  __m512 top[H];
  UNROLLED for (int h = 0; h < H; ++h) top[h] = _mm512_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const __mmask16 visible = static_cast<__mmask16>(seen[j0 / 16]);
    __m512 dots[H];
    UNROLLED for (int h = 0; h < H; ++h) dots[h] = _mm512_setzero_ps();
    for (int64_t c0 = 0; visible && c0 < pairs; c0 += 16) {
      const __mmask16 columns = score_lanes(pairs - c0);  // the pairs c0 .. c0 + 15 the head has
      __m512i kt[16];
      UNROLLED for (int i = 0; i < 16; ++i)  // keys past the part's are masked out (and their loads not made)
        kt[i] = _mm512_maskz_loadu_epi32(j0 + i < n ? columns : 0, a.k + (j0 + i) * a.k_stride + 2 * c0);
      transpose_dwords(kt);
      UNROLLED for (int c = 0; c < 16; ++c) {
        if (c0 + c >= pairs) break;
        UNROLLED for (int h = 0; h < H; ++h) {
          const __m512i q_pair = _mm512_set1_epi32(bf16_pair(a.q + (h0 + h) * a.q_head_stride + 2 * (c0 + c)));
          dots[h] = _mm512_dpbf16_ps(dots[h], (__m512bh)kt[c], (__m512bh)q_pair);
        }
      }
    }
    UNROLLED for (int h = 0; h < H; ++h) keep_scores(a, visible, dots[h], p + (h0 + h) * n + j0, n - j0, top[h]);
  }
  UNROLLED for (int h = 0; h < H; ++h) finish_softmax(a, h0 + h, p + (h0 + h) * n, top[h]);
}

// From this many query heads per KV head the keys-in-lanes scores (softmax_scores_bf16_group) are the faster: their
// transposition (64 shuffles a block and 32 columns) is shared by the heads, where softmax_scores_bf16's sum of 16
// dot vectors (45 shuffles and adds a block) is per head; with one or two heads the transposition costs more.
constexpr int64_t KEYS_IN_LANES_MIN_HEADS = 3;

// The part's group's heads from h0 through softmax_scores_bf16_heads, H at a time, the rest as one chunk (as
// weighted_values_in_place).
template <int H = 8>
void softmax_scores_bf16_group(const AttentionPart<at::BFloat16>& a, const uint32_t* seen, float* p, int64_t h0 = 0) {
  for (; h0 + H <= a.heads; h0 += H) softmax_scores_bf16_heads<H>(a, seen, h0, p);
  if constexpr (H > 1) {
    if (h0 < a.heads) softmax_scores_bf16_group<H - 1>(a, seen, p, h0);
  }
}

// Every head's softmax from float32 query and keys (the part's own, or widened copies) into p [heads][keys]: the
// scores block by block of keys (key_block), every head's for one block before the next, each head's largest score
// so far kept in its out row; then each head's finish_softmax.
template <typename T>
void softmax_scores_float(const AttentionPart<T>& a, const FloatPart& f, const uint32_t* seen, float* p) {
  const int64_t d = a.dim, n = a.keys, block = key_block(d, 16);
  for (int64_t h = 0; h < a.heads; ++h) a.out[h * (d + 2) + d] = -INFINITY;
  for (int64_t b0 = 0; b0 < n; b0 += block)
    for (int64_t h = 0; h < a.heads; ++h) {
      float& largest = a.out[h * (d + 2) + d];
      __m512 top = _mm512_set1_ps(largest);
      scores_of_keys(a, seen, b0, std::min(b0 + block, n), p + h * n, top,
                     [&](int64_t j0, int64_t keys_here, __m512 (&dots)[16]) {
                       key_dots<16>(f.q + h * d, f.keys + j0 * f.k_stride, f.k_stride, keys_here, d / 16, dots);
                     });
      largest = _mm512_reduce_max_ps(top);
    }
  for (int64_t h = 0; h < a.heads; ++h) finish_softmax(a, h, p + h * n, _mm512_set1_ps(a.out[h * (d + 2) + d]));
}

// out rows of heads h0 .. h0 + HEADS - 1: sum over the visible keys j of p[h][j] * values[j] (V vectors of 16), each
// value row (fp32, or bf16 widened in registers) loaded once for the HEADS heads.
template <typename T, int V, int HEADS>
void weighted_heads(const AttentionPart<T>& a, const float* p, const uint32_t* seen, int64_t h0) {
  const int64_t d = a.dim, n = a.keys;
  __m512 acc[HEADS][V];
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < V; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t block = 0; block < (n + 15) / 16; ++block)
    for (uint32_t bits = seen[block]; bits != 0; bits &= bits - 1) {
      const int64_t j = block * 16 + __builtin_ctz(bits);
      const T* row = a.v + j * a.v_stride;
      __m512 w[HEADS];
      for (int h = 0; h < HEADS; ++h) w[h] = _mm512_set1_ps(p[(h0 + h) * n + j]);
      for (int c = 0; c < V; ++c) {
        const __m512 values = load_f32x16(row + 16 * c);
        for (int h = 0; h < HEADS; ++h) acc[h][c] = _mm512_fmadd_ps(w[h], values, acc[h][c]);
      }
    }
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(a.out + (h0 + h) * (d + 2) + 16 * c, acc[h][c]);
}

// The group's heads in chunks of up to H = min(8, 16 / V) (at most 16 accumulators): a group of 3 heads (SmolLM2) as
// one chunk of 3, not three of 1.
template <typename T, int V, int H = std::max(1, std::min(8, 16 / V))>
void weighted_values_in_place(const AttentionPart<T>& a, const float* p, const uint32_t* seen, int64_t h0 = 0) {
  for (; h0 + H <= a.heads; h0 += H) weighted_heads<T, V, H>(a, p, seen, h0);
  if constexpr (H > 1) {
    if (h0 < a.heads) weighted_values_in_place<T, V, H - 1>(a, p, seen, h0);
  }
}

// out rows of heads h0 .. h0 + HEADS - 1 from bf16 values, two keys at a time: each 32 columns of the two value rows
// are interleaved into column pairs (vpunpcklwd / vpunpckhwd, keys past the part or not visible read as 0), and each
// head's vdpbf16ps with its two probabilities (pb, rounded to bf16 as Hugging Face's bf16 attention rounds them)
// broadcast adds both keys' products to 16 columns; the interleaving is shared by the heads, and the columns it
// permutes within each 128-bit lane are put back in order once at the end. V (head_dim / 16) is even.
template <int V, int HEADS>
void weighted_heads_in_pairs(const AttentionPart<at::BFloat16>& a, const at::BFloat16* pb, int64_t pb_stride,
                             const uint32_t* seen, int64_t h0) {
  static_assert(V % 2 == 0, "32 columns a step");
  const int64_t d = a.dim, n = a.keys;
  __m512 acc[HEADS][V];
  UNROLLED for (int h = 0; h < HEADS; ++h)
    UNROLLED for (int c = 0; c < V; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 2) {
    const uint32_t bits = seen[j / 16] >> (j % 16);  // j even: j and j + 1 are in one block of 16
    if ((bits & 3) == 0) continue;
    const __mmask32 first = (bits & 1) ? ~__mmask32(0) : 0, second = (bits & 2) ? ~__mmask32(0) : 0;
    __m512bh weights[HEADS];
    UNROLLED for (int h = 0; h < HEADS; ++h)
      weights[h] = (__m512bh)_mm512_set1_epi32(bf16_pair(pb + (h0 + h) * pb_stride + j));
    UNROLLED for (int c = 0; c < V / 2; ++c) {
      const __m512i row0 = _mm512_maskz_loadu_epi16(first, a.v + j * a.v_stride + 32 * c);
      const __m512i row1 = _mm512_maskz_loadu_epi16(second, a.v + (j + 1) * a.v_stride + 32 * c);
      const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(row0, row1);
      const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(row0, row1);
      UNROLLED for (int h = 0; h < HEADS; ++h) {
        acc[h][2 * c] = _mm512_dpbf16_ps(acc[h][2 * c], low, weights[h]);
        acc[h][2 * c + 1] = _mm512_dpbf16_ps(acc[h][2 * c + 1], high, weights[h]);
      }
    }
  }
  // lane 4L + i of low holds column 8L + i of the 32, of high column 8L + 4 + i (L the 128-bit lane, i < 4)
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  UNROLLED for (int h = 0; h < HEADS; ++h)
    UNROLLED for (int c = 0; c < V / 2; ++c) {
      float* out = a.out + (h0 + h) * (d + 2) + 32 * c;
      _mm512_storeu_ps(out, _mm512_permutex2var_ps(acc[h][2 * c], first_half, acc[h][2 * c + 1]));
      _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(acc[h][2 * c], second_half, acc[h][2 * c + 1]));
    }
}

// The group's heads from h0 through weighted_heads_in_pairs, H at a time, the rest as one chunk (as
// weighted_values_in_place).
template <int V, int H>
void heads_in_pairs(const AttentionPart<at::BFloat16>& a, const at::BFloat16* pb, int64_t pb_stride,
                    const uint32_t* seen, int64_t h0 = 0) {
  for (; h0 + H <= a.heads; h0 += H) weighted_heads_in_pairs<V, H>(a, pb, pb_stride, seen, h0);
  if constexpr (H > 1) {
    if (h0 < a.heads) heads_in_pairs<V, H - 1>(a, pb, pb_stride, seen, h0);
  }
}

// The group's weighted values through weighted_heads_in_pairs, up to H heads at a time (at most 16 accumulators),
// after rounding their probabilities to bf16 (two keys a dword; a part's odd last key gets a 0 beside it).
template <int V, int H = std::max(1, std::min(8, 16 / V))>
void weighted_values_in_pairs(const AttentionPart<at::BFloat16>& a, const float* p, const uint32_t* seen,
                              std::vector<at::BFloat16>& rounded) {
  const int64_t n = a.keys, stride = (n + 31) / 32 * 32;
  rounded.resize(a.heads * stride);
  for (int64_t h = 0; h < a.heads; ++h)
    for (int64_t j = 0; j < stride; j += 32) {
      const __m512 low = _mm512_maskz_loadu_ps(score_lanes(n - j), p + h * n + j);
      const __m512 high = _mm512_maskz_loadu_ps(n - j > 16 ? score_lanes(n - j - 16) : 0, p + h * n + j + 16);
      _mm512_storeu_si512(rounded.data() + h * stride + j, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
  heads_in_pairs<V, H>(a, rounded.data(), stride, seen);
}

// Whether weighted_values_in_pairs has a version for head_dim = 16 * vectors.
inline bool values_in_pairs(int64_t vectors) { return vectors == 2 || vectors == 4 || vectors == 6 || vectors == 8; }

inline void weighted_values_in_pairs(const AttentionPart<at::BFloat16>& a, const float* p, const uint32_t* seen,
                                     std::vector<at::BFloat16>& rounded) {
  switch (a.dim / 16) {
    case 2: return weighted_values_in_pairs<2>(a, p, seen, rounded);
    case 4: return weighted_values_in_pairs<4>(a, p, seen, rounded);
    case 6: return weighted_values_in_pairs<6>(a, p, seen, rounded);
    case 8: return weighted_values_in_pairs<8>(a, p, seen, rounded);
  }
}

// Whether weighted_values_in_place has a version for head_dim = 16 * vectors.
inline bool values_in_place(int64_t vectors) { return vectors <= 6 || vectors == 8 || vectors == 16; }

template <typename T>
void weighted_values_in_place(const AttentionPart<T>& a, const float* p, const uint32_t* seen) {
  switch (a.dim / 16) {
    case 1: return weighted_values_in_place<T, 1>(a, p, seen);
    case 2: return weighted_values_in_place<T, 2>(a, p, seen);
    case 3: return weighted_values_in_place<T, 3>(a, p, seen);
    case 4: return weighted_values_in_place<T, 4>(a, p, seen);
    case 5: return weighted_values_in_place<T, 5>(a, p, seen);
    case 6: return weighted_values_in_place<T, 6>(a, p, seen);
    case 8: return weighted_values_in_place<T, 8>(a, p, seen);
    case 16: return weighted_values_in_place<T, 16>(a, p, seen);
  }
}

// Every head's softmax, then the weighted values. Where weighted_values_in_place has the head size, the values are
// read where they are and the keys too (bf16 by vdpbf16ps, with the keys in lanes for groups of
// KEYS_IN_LANES_MIN_HEADS heads or more, and the values two keys at a time where head_dim is a multiple of 32 up to
// 128; fp32 need no copy); else the part's keys and values are widened into float32 buffers and each head's values
// summed alone (weighted_values).
template <typename T>
void attend_part(const AttentionPart<T>& a, AttentionScratch& scratch) {
  const int64_t d = a.dim, n = a.keys, vectors = d / 16;
  const bool in_place = values_in_place(vectors);
  scratch.scores.resize(a.heads * n);
  float* p = scratch.scores.data();
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (in_place) {
      visible_bits(a.visible, a.visible_stride, n, scratch.seen);
      if (a.heads >= KEYS_IN_LANES_MIN_HEADS)
        softmax_scores_bf16_group(a, scratch.seen.data(), p);
      else
        for (int64_t h = 0; h < a.heads; ++h) softmax_scores_bf16(a, scratch.seen.data(), h, p + h * n);
      if (values_in_pairs(vectors)) return weighted_values_in_pairs(a, p, scratch.seen.data(), scratch.probabilities);
      return weighted_values_in_place(a, p, scratch.seen.data());
    }
  }
  const FloatPart f = part_as_float(a, scratch, widen_row);
  softmax_scores_float(a, f, scratch.seen.data(), p);
  if (in_place) return weighted_values_in_place(a, p, scratch.seen.data());
  for (int64_t h = 0; h < a.heads; ++h)
    with_vectors(vectors, [&](auto v) {
      weighted_values<decltype(v)::value>(p + h * n, f.values, f.v_stride, n, vectors, a.out + h * (d + 2));
    });
}

}  // namespace avx512
#pragma GCC pop_options

// ---- AVX2 + FMA ------------------------------------------------------------------------------------------------------
// The same kernels for CPUs without AVX-512 BF16: weights are widened to float32 (bf16 by a shift, int8 by sign
// extension and conversion, int4 nibbles by shift and mask) and multiply-added 8 lanes at a time; x is converted to
// float32 once per call. AVX2 has 16 vector registers, so x is taken two rows at a time against four weight rows. The
// integer dot products (int8_dot_gemv, int4_dot_gemv) multiply bytes with vpmaddubsw instead.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

constexpr int64_t X_ROWS = 2;

inline __m256 bf16x8_to_f32(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline __m256 int8x8_to_f32(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// A bf16 value broadcast as float32: its bits as 16-bit words, each 32-bit lane shifted to hold them as float32.
inline __m256 broadcast_bf16(const at::BFloat16* p) {
  const int16_t bits = *reinterpret_cast<const int16_t*>(p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi16(bits), 16));
}

inline int32_t horizontal_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

at::Tensor to_float(const at::Tensor& x) { return x.to(at::kFloat).contiguous(); }

inline __m256 widen(const at::BFloat16* p) { return bf16x8_to_f32(p); }
inline __m256 widen(const int8_t* p) { return int8x8_to_f32(p); }

// Four weight rows (R) against M rows of x; 32 columns per step, then 8 at a time, then one: sums[m][r] in float32.
// APART: the rows are far apart (one per weight stream, as the row pairs below walk them), each prefetched
// PREFETCH_BYTES ahead in itself; else they are a block's neighbours (prefetch_step). With one row of x each sum runs
// in two chains (columns c .. c + 7 to chain (c / 8) % 2), else the multiply-adds of one or two weight rows would wait
// on each other's latency; with two rows of x there are chains enough, and two a sum would not fit the 16 registers.
// So every R (weight streams) gives an output the same bits, and a row of x computed alone may differ from one
// computed beside another in the last bits.
template <int M, int R, typename T, bool APART = false>
void rows_dot(const float* x, const T* const row_at[R], int64_t k, float sums[M][R]) {
  constexpr int CHAINS = M == 1 ? 2 : 1;
  __m256 acc[M][R][CHAINS];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int r = 0; r < R; ++r)
      UNROLLED for (int h = 0; h < CHAINS; ++h) acc[m][r][h] = _mm256_setzero_ps();
  const auto step = [&](int64_t c, int chain) {  // columns c .. c + 7 into chain
    __m256 wv[R];
    UNROLLED for (int r = 0; r < R; ++r) wv[r] = widen(row_at[r] + c);
    UNROLLED for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * k + c);
      UNROLLED for (int r = 0; r < R; ++r) acc[m][r][chain] = _mm256_fmadd_ps(wv[r], xv, acc[m][r][chain]);
    }
  };
  const int64_t k32 = k / 32 * 32, k8 = k / 8 * 8;
  int64_t c = 0;
  for (; c < k32; c += 32) {
    if constexpr (APART) {
      UNROLLED for (int r = 0; r < R; ++r) prefetch<prefetch_kind<T>()>(row_at[r] + c + PREFETCH_BYTES / sizeof(T), M);
    } else {
      prefetch_step<R, 32>(row_at, k, c, M);
    }
    UNROLLED for (int j = 0; j < 4; ++j) step(c + 8 * j, j % CHAINS);
  }
  UNROLLED for (int j = 0; j < 3; ++j)  // up to three groups of 8 past the last 32; k32 / 8 is even, so chain j % 2
    if (c + 8 * j < k8) step(c + 8 * j, j % CHAINS);
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int r = 0; r < R; ++r) {
      __m256 chains = acc[m][r][0];
      UNROLLED for (int h = 1; h < CHAINS; ++h) chains = _mm256_add_ps(chains, acc[m][r][h]);
      float total = horizontal_sum(chains);
      for (int64_t t = k8; t < k; ++t) total += x[m * k + t] * static_cast<float>(row_at[r][t]);
      sums[m][r] = total;
    }
}

template <int M, int R>
void bf16_rows(const float* x, const at::BFloat16* w, int64_t k, RowBlock block, at::BFloat16* out,
               int64_t n_total) {
  if constexpr (R == 8) {
    for_row_sets<2>(w, k, block, [&](const int64_t rows[2], const at::BFloat16* const row_at[2]) {
      float sums[M][2];
      rows_dot<M, 2, at::BFloat16, true>(x, row_at, k, sums);
      UNROLLED for (int m = 0; m < M; ++m)
        for (int t = 0; t < 2; ++t) out[m * n_total + rows[t]] = at::BFloat16(sums[m][t]);
    });
  } else {
    const at::BFloat16* row_at[R];
    row_pointers<R>(w, k, block, row_at);
    float sums[M][R];
    rows_dot<M, R>(x, row_at, k, sums);
    UNROLLED for (int m = 0; m < M; ++m)
      UNROLLED for (int r = 0; r < R; ++r) out[m * n_total + block.row(r)] = at::BFloat16(sums[m][r]);
  }
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  const at::Tensor xf = to_float(x);
  auto out = kernel_output({m, n}, x.options());
  const float* xp = xf.data_ptr<float>();
  const auto* wp = w.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  for_row_blocks<X_ROWS>(m, n, [&](auto m_c, auto r_c, RowBlock rows, int64_t m0) {
    bf16_rows<decltype(m_c)::value, decltype(r_c)::value>(xp + m0 * k, wp, k, rows, op + m0 * n, n);
  });
  return out;
}

template <int M, int R>
void int8_rows(const float* x, const int8_t* w, const at::BFloat16* scales, int64_t k, RowBlock block,
               at::BFloat16* out, int64_t n_total) {
  // all eight rows at once even for two streams: widening int8 to float costs more arithmetic per byte than bf16, and
  // a row pair's two multiply-add chains alone cannot keep up with the reads (docs/kernels.md)
  const int8_t* row_at[R];
  row_pointers<R>(w, k, block, row_at);
  float sums[M][R];
  rows_dot<M, R>(x, row_at, k, sums);
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int r = 0; r < R; ++r)
      out[m * n_total + block.row(r)] = at::BFloat16(sums[m][r] * static_cast<float>(scales[block.row(r)]));
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  const at::Tensor xf = to_float(x);
  auto out = kernel_output({m, n}, x.options());
  const float* xp = xf.data_ptr<float>();
  const auto* sp = scales.data_ptr<at::BFloat16>();
  const int8_t* wp = w.data_ptr<int8_t>();
  auto* op = out.data_ptr<at::BFloat16>();
  for_row_blocks<X_ROWS>(m, n, [&](auto m_c, auto r_c, RowBlock rows, int64_t m0) {
    int8_rows<decltype(m_c)::value, decltype(r_c)::value>(xp + m0 * k, wp, sp, k, rows, op + m0 * n, n);
  });
  return out;
}

// vpdpbusd on 256-bit registers (AVX-VNNI): acc's int32 lanes plus the sums of their four products of u8's unsigned
// and s8's signed bytes: vpmaddubsw, vpmaddwd with ones and an add in one instruction, the same integers. Written in
// assembly so the AVX2 kernels that use it need no target of their own; they run it only where avx_vnni_ready().
inline __m256i dpbusd_avx(__m256i acc, __m256i u8, __m256i s8) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u8), "x"(s8));
  return acc;
}

// ---- int8 x int8 dot products (vpmaddubsw, or AVX-VNNI's vpdpbusd) ----------------------------------------------
// int8_dot_gemv's arithmetic on AVX2 (x rounded to int8 per row and block of 32, integer sums per block). vpmaddubsw
// multiplies unsigned by signed bytes into saturating 16-bit pair sums, so the weight goes in as |w| (0..128) and x as
// q with w's sign (-127..127): a pair sums to at most 2 * 128 * 127 < 2^15, no saturation. vpmaddwd with ones then sums
// the pairs into 8 int32 lanes, one block of 32 columns per step.
struct DotRows {
  std::vector<int8_t> q;  // [m, k]
  std::vector<float> d;   // [m, k / 32]
};

// The rounding scale of one block of x (n columns, a multiple of 8), as qmath.round_activations takes it: the absolute
// max (at least 1e-12) / levels; NaN where the block holds a NaN (a vector max would drop it), so its products are NaN
// as qmath's are.
inline float block_scale(const at::BFloat16* x, int64_t n, float levels) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int64_t c = 0; c < n; c += 8) {
    const __m256 v = bf16x8_to_f32(x + c);
    amax = _mm256_max_ps(_mm256_andnot_ps(sign, v), amax);  // a NaN lane keeps amax
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  return _mm256_movemask_ps(nan) ? NAN : std::max(horizontal_max(amax), 1e-12f) / levels;
}

// Eight columns of x as codes (int32 lanes): round-to-nearest-even(x / d) clamped to -levels..levels (a NaN lane
// gives -levels).
inline __m256i round8(const at::BFloat16* x, __m256 d, __m256 levels) {
  const __m256 rounded =
      _mm256_round_ps(_mm256_div_ps(bf16x8_to_f32(x), d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 low = _mm256_sub_ps(_mm256_setzero_ps(), levels);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, low), levels));
}

// Eight lanes at a time, each step as qmath.round_activations takes it (block_scale with 127 levels, round8), so the
// same bytes as round_rows at every level.
DotRows round_rows(const at::BFloat16* x, int64_t m, int64_t k) {
  DotRows a;
  a.q.resize(m * k);
  a.d.resize(m * k / DOT_BLOCK);
  const __m256 levels = _mm256_set1_ps(127.f);
  for (int64_t b = 0; b < m * k / DOT_BLOCK; ++b) {
    const float d = block_scale(x + b * DOT_BLOCK, DOT_BLOCK, 127.f);
    const __m256 dv = _mm256_set1_ps(d);
    __m256i codes[DOT_BLOCK / 8];
    for (int64_t j = 0; j < DOT_BLOCK / 8; ++j) codes[j] = round8(x + b * DOT_BLOCK + 8 * j, dv, levels);
    // int32 -> int8 (packs saturate, but every code is already in -127..127), back in column order
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(codes[0], codes[1]), 0xD8);
    const __m256i words2 = _mm256_permute4x64_epi64(_mm256_packs_epi32(codes[2], codes[3]), 0xD8);
    const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(words, words2), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + b * DOT_BLOCK), bytes);
    a.d[b] = d;
  }
  return a;
}

// Block b (DOT_BLOCK columns) of S weight rows, and the words' magnitudes for block_dots; each stream prefetched in
// itself, a line every other block.
template <int S>
inline void load_block(const int8_t* const (&row_at)[S], int64_t b, int64_t rows_of_x, __m256i (&wv)[S],
                       __m256i (&magnitude)[S]) {
  const int64_t c = b * DOT_BLOCK;
  UNROLLED for (int t = 0; t < S; ++t) {
    if (b % 2 == 0) prefetch<PREFETCH_INT8>(row_at[t] + c + PREFETCH_BYTES, rows_of_x);
    wv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_at[t] + c));
    magnitude[t] = _mm256_abs_epi8(wv[t]);
  }
}

// A block's eight int32 lane sums of w's and x's int8 products: |w| (magnitude) times x with w's sign, each lane's four
// products summed (AVX-VNNI's vpdpbusd, or vpmaddubsw and vpmaddwd with ones: the same integers).
template <bool VNNI>
inline __m256i block_dots(__m256i magnitude, __m256i w, __m256i x) {
  const __m256i signed_x = _mm256_sign_epi8(x, w);
  return VNNI ? dpbusd_avx(_mm256_setzero_si256(), magnitude, signed_x)
              : _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), _mm256_set1_epi16(1));
}

template <bool VNNI, int M, int R>
void int8_dot_rows(const DotRows& a, int64_t m0, const int8_t* w, const at::BFloat16* scales, int64_t k,
                   RowBlock block, at::BFloat16* out, int64_t n_total) {
  constexpr int m_rows = M, rows = R;
  const int64_t blocks = k / DOT_BLOCK;
  const int8_t* row_at[R];
  row_pointers<R>(w, k, block, row_at);
  __m256 acc[M][R];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t c = b * DOT_BLOCK;
    prefetch_step<R, DOT_BLOCK>(row_at, k, c, M);
    __m256i wv[R], magnitude[R];
    UNROLLED for (int r = 0; r < rows; ++r) {
      wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_at[r] + c));
      magnitude[r] = _mm256_abs_epi8(wv[r]);
    }
    UNROLLED for (int m = 0; m < m_rows; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m0 + m) * k + c));
      const __m256 d = _mm256_set1_ps(a.d[(m0 + m) * blocks + b]);
      UNROLLED for (int r = 0; r < rows; ++r) {
        acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dots<VNNI>(magnitude[r], wv[r], xv)), d, acc[m][r]);
      }
    }
  }
  UNROLLED for (int m = 0; m < m_rows; ++m)
    UNROLLED for (int r = 0; r < rows; ++r)
      out[m * n_total + block.row(r)] = at::BFloat16(horizontal_sum(acc[m][r]) *
                                                     static_cast<float>(scales[block.row(r)]));
}

// The two weight streams' eight rows as pairs (for_row_sets<2>), each stream prefetched in itself; each row's
// arithmetic is int8_dot_rows', so the outputs are the same bits.
template <bool VNNI, int M>
void int8_dot_row_pairs(const DotRows& a, int64_t m0, const int8_t* w, const at::BFloat16* scales, int64_t k,
                        RowBlock block, at::BFloat16* out, int64_t n_total) {
  const int64_t blocks = k / DOT_BLOCK;
  for_row_sets<2>(w, k, block, [&](const int64_t (&rows)[2], const int8_t* const (&row_at)[2]) {
    __m256 acc[M][2];
    UNROLLED for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c = b * DOT_BLOCK;
      __m256i wv[2], magnitude[2];
      load_block<2>(row_at, b, M, wv, magnitude);
      UNROLLED for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m0 + m) * k + c));
        const __m256 d = _mm256_set1_ps(a.d[(m0 + m) * blocks + b]);
        for (int t = 0; t < 2; ++t) {
          acc[m][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dots<VNNI>(magnitude[t], wv[t], xv)), d, acc[m][t]);
        }
      }
    }
    UNROLLED for (int m = 0; m < M; ++m)
      for (int t = 0; t < 2; ++t)
        out[m * n_total + rows[t]] = at::BFloat16(horizontal_sum(acc[m][t]) * static_cast<float>(scales[rows[t]]));
  });
}

template <bool VNNI>
at::Tensor int8_dot_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  const DotRows a = round_rows(x.data_ptr<at::BFloat16>(), m, k);
  auto out = kernel_output({m, n}, x.options());
  const auto* sp = scales.data_ptr<at::BFloat16>();
  const int8_t* wp = w.data_ptr<int8_t>();
  auto* op = out.data_ptr<at::BFloat16>();
  for_row_blocks<X_ROWS>(m, n, [&](auto m_c, auto r_c, RowBlock rows, int64_t m0) {
    if constexpr (decltype(r_c)::value == 8)
      int8_dot_row_pairs<VNNI, decltype(m_c)::value>(a, m0, wp, sp, k, rows, op + m0 * n, n);
    else
      int8_dot_rows<VNNI, decltype(m_c)::value, decltype(r_c)::value>(a, m0, wp, sp, k, rows, op + m0 * n, n);
  });
  return out;
}

// A grouped int8 weight (see avx512::int8_dot_gemv_grouped) on int8_dot_rows' arithmetic, S weight rows (rows[t], at
// row_at[t]) over every column: each block's sum times x's block scale into the group's sums, which at the group's
// end are multiplied by the row's scale of that group (the weight is never flipped here, so no excess is taken off).
template <bool VNNI, int M, int S>
void int8_dot_grouped_set(const DotRows& a, int64_t m0, const int64_t (&rows)[S], const int8_t* const (&row_at)[S],
                          const GroupedScales& gs, int64_t k, at::BFloat16* out, int64_t n_total) {
  const int64_t blocks = k / DOT_BLOCK, per_group = gs.group / DOT_BLOCK;
  __m256 acc[M][S];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int t = 0; t < S; ++t) acc[m][t] = _mm256_setzero_ps();
  for (int64_t first = 0; first < blocks; first += per_group) {
    __m256 group_sums[M][S];
    UNROLLED for (int m = 0; m < M; ++m)
      UNROLLED for (int t = 0; t < S; ++t) group_sums[m][t] = _mm256_setzero_ps();
    for (int64_t b = first; b < first + per_group; ++b) {
      const int64_t c = b * DOT_BLOCK;
      __m256i wv[S], magnitude[S];
      load_block<S>(row_at, b, M, wv, magnitude);
      UNROLLED for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m0 + m) * k + c));
        const __m256 d = _mm256_set1_ps(a.d[(m0 + m) * blocks + b]);
        UNROLLED for (int t = 0; t < S; ++t) {
          const __m256 sums = _mm256_cvtepi32_ps(block_dots<VNNI>(magnitude[t], wv[t], xv));
          group_sums[m][t] = _mm256_fmadd_ps(sums, d, group_sums[m][t]);
        }
      }
    }
    UNROLLED for (int t = 0; t < S; ++t) {
      const __m256 scale = broadcast_bf16(gs.of(rows[t], first));
      UNROLLED for (int m = 0; m < M; ++m) acc[m][t] = _mm256_fmadd_ps(group_sums[m][t], scale, acc[m][t]);
    }
  }
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int t = 0; t < S; ++t) out[m * n_total + rows[t]] = at::BFloat16(horizontal_sum(acc[m][t]));
}

template <bool VNNI>
at::Tensor int8_dot_gemv_grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  const GroupedScales gs(scales, k);
  const DotRows a = round_rows(x.data_ptr<at::BFloat16>(), m, k);
  auto out = kernel_output({m, n}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  auto* op = out.data_ptr<at::BFloat16>();
  // a block's rows side by side (four, or the tail's), or sets of two streams' rows (for_row_sets)
  for_row_blocks<GROUPED_X_ROWS>(m, n, [&](auto m_c, auto r_c, RowBlock block, int64_t m0) {
    constexpr int M = decltype(m_c)::value, R = decltype(r_c)::value, S = R > 4 ? R / 4 : R;
    const auto set = [&](const int64_t (&rows)[S], const int8_t* const (&row_at)[S]) {
      int8_dot_grouped_set<VNNI, M, S>(a, m0, rows, row_at, gs, k, op + m0 * n, n);
    };
    if constexpr (R > 4) {
      for_row_sets<S>(wp, k, block, set);
    } else {
      int64_t rows[R];
      const int8_t* row_at[R];
      for (int r = 0; r < R; ++r) rows[r] = block.row(r), row_at[r] = wp + rows[r] * k;
      set(rows, row_at);
    }
  });
  return out;
}

// ---- int8 x int16 dot products (vpmaddwd): int8 weight-only's decode rows at the avx2 level without AVX-VNNI ------
// Without VNNI, int8_dot_gemv's product of 32 columns per weight row and row of x is five vector instructions (a sign,
// vpmaddubsw, vpmaddwd with ones, a conversion, the block scale's multiply-add), against bf16's four multiply-adds
// (and its widening, shared by the rows of x): a batch bound by arithmetic gains little over bf16. Here x is rounded
// to int16 per row and block of DOT16_BLOCK columns (d = amax / 32767, round to nearest even), and a step of 16
// weights is sign-extended to int16 once for two rows of x: per 32 columns, weight row and row of x, two vpmaddwd and
// two adds into int32 sums, converted and scaled once per block. Four weight rows go together, so each load of x
// feeds four vpmaddwd: the loads, not the arithmetic, bound the kernel in the cache. Its step is finer than int8's
// per block of 32 wherever a block of 32 holds more than 1/258 of its block of 256's amax. A block's sums stay below
// 16 steps * 2 * 128 * 32767 < 2^28.
constexpr int64_t DOT16_X_ROWS = 8;  // rows of x per pass over a block of weight rows
constexpr int DOT16_CHUNK_ROWS = 2;  // rows of x whose sums share the registers with a group's widened step
constexpr int DOT16_GROUP_ROWS = 4;  // weight rows widened once a step for a chunk: each x load feeds four vpmaddwd

struct Dot16Rows {
  at::Tensor q;           // [m, k] int16 (ATen's CPU buffers start on a cache line: no load of a step splits one)
  std::vector<float> d;   // [m, blocks]
  int64_t blocks;         // ceil(k / DOT16_BLOCK): the last block holds what is left
};

// x rounded as qmath.round_activations rounds it with WIDE_ACTIVATION_LEVELS (block_scale with 32767 levels, round8)
// per row and block of DOT16_BLOCK.
Dot16Rows round_rows16(const at::BFloat16* x, int64_t m, int64_t k) {
  Dot16Rows a;
  a.blocks = (k + DOT16_BLOCK - 1) / DOT16_BLOCK;
  a.q = at::empty({m, k}, at::kShort);
  a.d.resize(m * a.blocks);
  int16_t* q = a.q.data_ptr<int16_t>();
  const __m256 levels = _mm256_set1_ps(32767.f);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t c0 = b * DOT16_BLOCK, c1 = std::min(c0 + DOT16_BLOCK, k);
      const at::BFloat16* row = x + i * k;
      const float d = block_scale(row + c0, c1 - c0, 32767.f);
      const __m256 dv = _mm256_set1_ps(d);
      for (int64_t c = c0; c < c1; c += 16) {
        const __m256i codes[2] = {round8(row + c, dv, levels), round8(row + c + 8, dv, levels)};
        const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(codes[0], codes[1]), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * k + c), words);
      }
      a.d[i * a.blocks + b] = d;
    }
  return a;
}

// 16 int8 weights sign-extended to int16 (FLIPPED: stored as w + 128, the tiles' tail rows).
template <bool FLIPPED = false>
inline __m256i widen16(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (FLIPPED) return _mm256_sub_epi16(_mm256_cvtepu8_epi16(bytes), _mm256_set1_epi16(128));
  return _mm256_cvtepi8_epi16(bytes);
}

// C rows of x (x, the first of them; rows k apart) against R weight rows (row_at) over `columns` columns, both from
// the same column: their int32 pair sums in acc.
template <int C, int R, bool FLIPPED = false>
inline void dot16_chunk(const int16_t* x, int64_t k, const int8_t* const row_at[R], int64_t columns,
                        __m256i acc[C][R]) {
  UNROLLED for (int m = 0; m < C; ++m)
    UNROLLED for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_si256();
  // One step of 16 columns a pass: C * R sums, R widened weights and a row of x fill 13 of the 16 registers; GCC
  // unrolling the loop interleaves two steps and moves sums to the stack, which costs more than the loop.
#pragma GCC unroll 1
  for (int64_t c = 0; c < columns; c += 16) {
    __m256i wv[R];
    UNROLLED for (int r = 0; r < R; ++r) wv[r] = widen16<FLIPPED>(row_at[r] + c);
    UNROLLED for (int m = 0; m < C; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * k + c));
      UNROLLED for (int r = 0; r < R; ++r) acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(wv[r], xv));
    }
  }
}

// f(Int<first>, Int<size>) for [0, N) in pieces of STEP (the last one shorter), unrolled.
template <int N, int STEP, int FIRST = 0, typename F>
inline void for_pieces(F&& f) {
  if constexpr (FIRST < N) {
    f(Int<FIRST>{}, Int<(N - FIRST < STEP ? N - FIRST : STEP)>{});
    for_pieces<N, STEP, FIRST + STEP>(f);
  }
}

// A grouped weight's scales for dot16_rows: columns per group, and each of the R rows' scale of group 0 (its scale of
// group g SCALE_TILE values on, GroupedScales' layout); group 0 (per-channel scales, applied by the caller) for none.
template <int R>
struct Dot16Groups {
  int64_t group = 0;
  const at::BFloat16* first[R] = {};

  Dot16Groups(const GroupedScales* gs, const int64_t* rows) {
    if (!gs) return;
    group = gs->group;
    for (int r = 0; r < R; ++r) first[r] = gs->of(rows[r], 0);
  }
  // Row r's scale of group g, broadcast as float32.
  __m256 scale(int r, int64_t g) const { return broadcast_bf16(first[r] + g * SCALE_TILE); }
};

// R weight rows against M rows of x (a.q from row m0): sums[m][r] in float32. APART as rows_dot's. Each block of
// columns is taken by every row of x, in chunks of DOT16_CHUNK_ROWS rows against DOT16_GROUP_ROWS weight rows, before
// the next block, so the block's weights and x stay in L1. A grouped weight's block is walked in segments that end
// at its groups' ends: each segment's int32 sums times the row's scale of that group, summed in float32 over the
// block, then times x's block scale, as per-channel sums are.
template <int M, int R, bool APART, bool FLIPPED = false>
void dot16_rows(const Dot16Rows& a, int64_t m0, const int8_t* const row_at[R], int64_t k, const Dot16Groups<R>& grouped,
                float sums[M][R]) {
  __m256 total[M][R], part[M][R];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int r = 0; r < R; ++r) total[m][r] = _mm256_setzero_ps();
  const int16_t* x = a.q.data_ptr<int16_t>() + m0 * k;
  const int64_t group = grouped.group;
  int64_t g = 0;  // the group a segment is in
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int64_t c0 = b * DOT16_BLOCK, c1 = std::min(c0 + DOT16_BLOCK, k);
    for (int64_t c = c0; c < c1; c += 32) {
      if constexpr (APART) {
        if (c % 64 == 0)
          UNROLLED for (int r = 0; r < R; ++r) prefetch<PREFETCH_INT8>(row_at[r] + c + PREFETCH_BYTES, M);
      } else {
        prefetch_step<R, 32>(row_at, k, c, M);
      }
    }
    if (group)
      UNROLLED for (int m = 0; m < M; ++m)
        UNROLLED for (int r = 0; r < R; ++r) part[m][r] = _mm256_setzero_ps();
    for (int64_t s0 = c0, s1; s0 < c1; s0 = s1) {
      s1 = group ? std::min(c1, (g + 1) * group) : c1;
      for_pieces<R, DOT16_GROUP_ROWS>([&](auto r0_c, auto g_c) {
        constexpr int R0 = decltype(r0_c)::value, G = decltype(g_c)::value;
        const int8_t* group_at[G];
        UNROLLED for (int g = 0; g < G; ++g) group_at[g] = row_at[R0 + g] + s0;
        __m256 scale[G];
        if (group) UNROLLED for (int i = 0; i < G; ++i) scale[i] = grouped.scale(R0 + i, g);
        for_pieces<M, DOT16_CHUNK_ROWS>([&](auto mc_c, auto c_c) {
          constexpr int MC = decltype(mc_c)::value, C = decltype(c_c)::value;
          __m256i acc[C][G];
          dot16_chunk<C, G, FLIPPED>(x + MC * k + s0, k, group_at, s1 - s0, acc);
          UNROLLED for (int m = 0; m < C; ++m) {
            if (group) {
              UNROLLED for (int i = 0; i < G; ++i)
                part[MC + m][R0 + i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][i]), scale[i], part[MC + m][R0 + i]);
              continue;
            }
            const __m256 d = _mm256_set1_ps(a.d[(m0 + MC + m) * a.blocks + b]);
            UNROLLED for (int i = 0; i < G; ++i)
              total[MC + m][R0 + i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][i]), d, total[MC + m][R0 + i]);
          }
        });
      });
      if (group && s1 == (g + 1) * group) ++g;
    }
    if (group)
      UNROLLED for (int m = 0; m < M; ++m) {
        const __m256 d = _mm256_set1_ps(a.d[(m0 + m) * a.blocks + b]);
        UNROLLED for (int r = 0; r < R; ++r) total[m][r] = _mm256_fmadd_ps(part[m][r], d, total[m][r]);
      }
  }
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int r = 0; r < R; ++r) sums[m][r] = horizontal_sum(total[m][r]);
}

// A block of weight rows (for_row_blocks') against M rows of x from m0 into out: per-channel scales (scales, one per
// row) or a grouped weight's (gs, with scales null). FLIPPED: the rows stored as w + 128 (the tiles' tail rows).
template <int M, int R, bool FLIPPED = false>
void int8_dot16_block(const Dot16Rows& a, int64_t m0, const int8_t* w, const at::BFloat16* scales,
                      const GroupedScales* gs, int64_t k, RowBlock block, at::BFloat16* out, int64_t n_total) {
  const auto store = [&](const auto& rows, const auto& sums, auto r_c) {
    UNROLLED for (int m = 0; m < M; ++m)
      UNROLLED for (int r = 0; r < decltype(r_c)::value; ++r)
        out[m * n_total + rows[r]] = at::BFloat16(gs ? sums[m][r] : sums[m][r] * static_cast<float>(scales[rows[r]]));
  };
  if constexpr (R == 8) {
    for_row_sets<2>(w, k, block, [&](const int64_t rows[2], const int8_t* const row_at[2]) {
      const Dot16Groups<2> grouped(gs, rows);
      float sums[M][2];
      dot16_rows<M, 2, true, FLIPPED>(a, m0, row_at, k, grouped, sums);
      store(rows, sums, Int<2>{});
    });
  } else {
    const int8_t* row_at[R];
    row_pointers<R>(w, k, block, row_at);
    int64_t rows[R];
    UNROLLED for (int r = 0; r < R; ++r) rows[r] = block.row(r);
    const Dot16Groups<R> grouped(gs, rows);
    float sums[M][R];
    dot16_rows<M, R, false, FLIPPED>(a, m0, row_at, k, grouped, sums);
    store(rows, sums, Int<R>{});
  }
}

// int8_dot16_gemv's product for per-channel scales, or (gs) a grouped weight's.
at::Tensor int8_dot16_product(const at::Tensor& x, const at::Tensor& w, const at::BFloat16* scales,
                              const GroupedScales* gs) {
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  const Dot16Rows a = round_rows16(x.data_ptr<at::BFloat16>(), m, k);
  auto out = kernel_output({m, n}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  auto* op = out.data_ptr<at::BFloat16>();
  for_row_blocks<DOT16_X_ROWS>(m, n, [&](auto m_c, auto r_c, RowBlock rows, int64_t m0) {
    int8_dot16_block<decltype(m_c)::value, decltype(r_c)::value>(a, m0, wp, scales, gs, k, rows, op + m0 * n, n);
  });
  return out;
}

at::Tensor int8_dot16_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  return int8_dot16_product(x, w, scales.data_ptr<at::BFloat16>(), nullptr);
}

// ---- grouped int8 on int16 activations, the weight in int8 tiles ----------------------------------------------------
// In the tiles of int8_tile_pack, 16 rows' four columns c .. c + 3 are 64 bytes at 16 c from the rows' first byte
// (every step's vectors in sequence), each byte w + 128. Sixteen of them (four rows' four columns) zero-extended to
// int16 and multiplied by x's four columns broadcast (vpmaddwd) give each row's two pair sums side by side in 8 int32
// lanes, so the lanes are weight rows and a group's end needs no horizontal sums: per four rows, one subtraction of
// the flipped bytes' excess (128 times the segment's sum of x, taken off one of each row's two lanes), a conversion
// and a multiply-add by the four rows' scales, each twice. Per four columns, 16 rows and two rows of x: four loads of
// weights, two of x and eight vpmaddwd and adds, as dot16_chunk's per 16 columns and four rows. A lane's sum over a
// segment (at most DOT16_BLOCK columns: 128 products of at most 255 * 32767) stays below 2^31.
constexpr int64_t DOT16_TILE_ROWS = 16;
constexpr int64_t DOT16_TILE_STREAM_ROWS = 4;  // rows of x up to which a thread reads two tiles side by side

// Segments of a row of x: [first, end) columns that share a block of x's scale and a group of the weight's.
struct Dot16Segments {
  std::vector<int64_t> first;  // and first.back() == k
  std::vector<int64_t> block;  // per segment, x's block
  std::vector<int32_t> excess;  // [m, segments]: 128 times the segment's sum of x's codes
};

Dot16Segments dot16_segments(const Dot16Rows& a, int64_t m, int64_t k, int64_t group) {
  Dot16Segments seg;
  for (int64_t c = 0; c < k;) {
    const int64_t end = std::min({k, (c / DOT16_BLOCK + 1) * DOT16_BLOCK, (c / group + 1) * group});
    seg.first.push_back(c), seg.block.push_back(c / DOT16_BLOCK);
    c = end;
  }
  seg.first.push_back(k);
  const int64_t count = seg.block.size();
  seg.excess.resize(m * count);
  const int16_t* q = a.q.data_ptr<int16_t>();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < count; ++j) {
      __m256i sum = _mm256_setzero_si256();  // segments are whole blocks of DOT_BLOCK: 16 columns a step
      for (int64_t c = seg.first[j]; c < seg.first[j + 1]; c += 16)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * k + c)), ones));
      seg.excess[i * count + j] = 128 * horizontal_sum(sum);  // at most 128 * 256 * 32767 < 2^31
    }
  return seg;
}

// sum += v (int32 lanes) in sum's own register, as inline assembly: see dot16_tile_chunk.
inline void add_in_place(__m256i& sum, __m256i v) { asm("vpaddd %1, %0, %0" : "+x"(sum) : "x"(v)); }

// Four rows' scales, each in two lanes (the lanes' order: row 0's two pair sums, row 1's, ...), from 4 bf16 at s.
inline __m256 four_row_scales(const at::BFloat16* s) {
  const __m128i words = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_unpacklo_epi16(words, words)), 16));
}

// C rows of x (x: the first, rows k apart) against a tile's 16 rows (w: the tile's first byte) over columns
// [c0, c1): acc[m][p] holds rows 4p .. 4p + 3's pair sums.
template <int C>
inline void dot16_tile_chunk(const int16_t* x, int64_t k, const uint8_t* w, int64_t c0, int64_t c1,
                             __m256i acc[C][4]) {
  UNROLLED for (int m = 0; m < C; ++m)
    UNROLLED for (int p = 0; p < 4; ++p) acc[m][p] = _mm256_setzero_si256();
  // Two rows of x add to each sum in place (add_in_place): GCC otherwise adds into the product's register and copies
  // it back, and with 8 sums, four weights, x and the products it keeps a sum on the stack. One row of x leaves GCC
  // registers enough (the assembly there has it keep the sums on the stack instead, with the folds' values).
#pragma GCC unroll 1
  for (int64_t c = c0; c < c1; c += 4) {
    __m256i wv[4];
    UNROLLED for (int p = 0; p < 4; ++p)
      wv[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c + 16 * p)));
    UNROLLED for (int m = 0; m < C; ++m) {
      const __m256i xv = _mm256_set1_epi64x(*reinterpret_cast<const int64_t*>(x + m * k + c));
      UNROLLED for (int p = 0; p < 4; ++p) {
        const __m256i product = _mm256_madd_epi16(wv[p], xv);
        if constexpr (C > 1) add_in_place(acc[m][p], product);
        else acc[m][p] = _mm256_add_epi32(acc[m][p], product);
      }
    }
  }
}

// M rows of x (from m0) times S tiles of 16 rows (the first from row n0, the next span rows on) into out, their
// segments in turn so the S streams are read side by side: per segment the int32 sums less the excess, times the rows'
// scales of its group, summed over x's block, then times the block's scale.
template <int M, int S>
void dot16_grouped_tiles(const Dot16Rows& a, const Dot16Segments& seg, int64_t m0, const uint8_t* w,
                         const GroupedScales& gs, int64_t k, int64_t n0, int64_t span, at::BFloat16* out,
                         int64_t n_total) {
  const int16_t* x = a.q.data_ptr<int16_t>() + m0 * k;
  const int64_t segments = seg.block.size();
  __m256 total[S][M][4], part[S][M][4];
  UNROLLED for (int t = 0; t < S; ++t)
    UNROLLED for (int m = 0; m < M; ++m)
      UNROLLED for (int p = 0; p < 4; ++p) total[t][m][p] = part[t][m][p] = _mm256_setzero_ps();
  for (int64_t j = 0; j < segments; ++j) {
    const int64_t c0 = seg.first[j], c1 = seg.first[j + 1];
    UNROLLED for (int t = 0; t < S; ++t) {
      const int64_t first_row = n0 + t * span;
      const uint8_t* tile = w + first_row * k;
      for (int64_t c = c0; c < c1; c += 4)
        prefetch<PREFETCH_INT8, _MM_HINT_T1>(tile + DOT16_TILE_ROWS * k + 16 * c, M);
      const at::BFloat16* line = gs.tile_line(first_row, c0 / DOT_BLOCK);
      __m256 scale[4];
      UNROLLED for (int p = 0; p < 4; ++p) scale[p] = four_row_scales(line + 4 * p);
      for_pieces<M, DOT16_CHUNK_ROWS>([&](auto mc_c, auto c_c) {
        constexpr int MC = decltype(mc_c)::value, C = decltype(c_c)::value;
        __m256i acc[C][4];
        dot16_tile_chunk<C>(x + MC * k, k, tile, c0, c1, acc);
        UNROLLED for (int m = 0; m < C; ++m) {
          const int32_t e = seg.excess[(m0 + MC + m) * segments + j];
          const __m256i off = _mm256_setr_epi32(e, 0, e, 0, e, 0, e, 0);
          UNROLLED for (int p = 0; p < 4; ++p)
            part[t][MC + m][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m][p], off)), scale[p],
                                                 part[t][MC + m][p]);
        }
      });
    }
    if (j + 1 < segments && seg.block[j + 1] == seg.block[j]) continue;
    UNROLLED for (int m = 0; m < M; ++m) {
      const __m256 d = _mm256_set1_ps(a.d[(m0 + m) * a.blocks + seg.block[j]]);
      UNROLLED for (int t = 0; t < S; ++t)
        UNROLLED for (int p = 0; p < 4; ++p) {
          total[t][m][p] = _mm256_fmadd_ps(part[t][m][p], d, total[t][m][p]);
          part[t][m][p] = _mm256_setzero_ps();
        }
    }
  }
  UNROLLED for (int t = 0; t < S; ++t)
    UNROLLED for (int m = 0; m < M; ++m) {
      alignas(32) float lanes[4][8];
      UNROLLED for (int p = 0; p < 4; ++p) _mm256_store_ps(lanes[p], total[t][m][p]);
      for (int r = 0; r < DOT16_TILE_ROWS; ++r)
        out[m * n_total + n0 + t * span + r] = at::BFloat16(lanes[r / 4][2 * (r % 4)] + lanes[r / 4][2 * (r % 4) + 1]);
    }
}

// int8_dot16_gemv_grouped on tiles: the whole tiles split over the threads (two side by side a thread up to
// DOT16_TILE_STREAM_ROWS rows of x), the row-major tail (stored flipped) on int8_dot16_block.
void int8_dot16_grouped_tiles(const Dot16Rows& a, int64_t m, const uint8_t* w, const GroupedScales& gs, int64_t n,
                              int64_t k, at::BFloat16* out) {
  const Dot16Segments seg = dot16_segments(a, m, k, gs.group);
  parallel_streams<2>(n / DOT16_TILE_ROWS, m, DOT16_TILE_STREAM_ROWS, [&](auto streams, int64_t unit, int64_t span) {
    for_x_chunks<DOT16_X_ROWS>(m, [&](auto m_c, int64_t m0) {
      dot16_grouped_tiles<decltype(m_c)::value, decltype(streams)::value>(
          a, seg, m0, w, gs, k, unit * DOT16_TILE_ROWS, span * DOT16_TILE_ROWS, out + m0 * n, n);
    });
  });
  const int64_t whole = n / DOT16_TILE_ROWS * DOT16_TILE_ROWS;
  if (!leads_team() || whole == n) return;
  const auto* rows = reinterpret_cast<const int8_t*>(w);
  for (int64_t row = whole; row < n; row += 4)
    with_rows(std::min<int64_t>(4, n - row), [&](auto r_c) {
      for_x_chunks<DOT16_X_ROWS>(m, [&](auto m_c, int64_t m0) {
        int8_dot16_block<decltype(m_c)::value, decltype(r_c)::value, true>(a, m0, rows, nullptr, &gs, k,
                                                                            RowBlock{row, 0}, out + m0 * n, n);
      });
    });
}

// int8_dot_gemv_grouped's weight and scales on int16 activations: x rounded as int8_dot16_gemv rounds it; w int8
// rows, or uint8 tiles (int8_dot16_grouped_tiles).
at::Tensor int8_dot16_gemv_grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  const GroupedScales gs(scales, k);
  if (w.scalar_type() == at::kChar) return int8_dot16_product(x, w, nullptr, &gs);
  const Dot16Rows a = round_rows16(x.data_ptr<at::BFloat16>(), m, k);
  auto out = kernel_output({m, n}, x.options());
  int8_dot16_grouped_tiles(a, m, w.data_ptr<uint8_t>(), gs, n, k, out.data_ptr<at::BFloat16>());
  return out;
}

// int4: lanes are weight rows, a 16-row tile is two halves of 8. Nibble slot s of a word (column ORDER[s] of the
// chunk) is shifted to bits 16-19 and OR-ed into the float 1.0, which gives 1 + q / 128 exactly (no conversion
// instruction; its product with a bf16 x is exact in float32), multiply-added with the broadcast x column. So the
// dot is sum(x) + sum(q x) / 128, and per group y += 128 * scale * dot + (zero - 136 * scale) * sum(x) for codes q
// in 0..15, value (q - 8) * scale + zero.
constexpr int ORDER[8] = {0, 2, 4, 6, 1, 3, 5, 7};

std::vector<float> group_sums(const float* x, int64_t m, int64_t k, int64_t group) {
  std::vector<float> sums(m * (k / group));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / group; ++g) {
      const float* p = x + r * k + g * group;
      __m256 s = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= group; j += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(p + j));
      float total = horizontal_sum(s);
      for (; j < group; ++j) total += p[j];
      sums[r * (k / group) + g] = total;
    }
  return sums;
}

// Tile half h's (scale, zero) from one line of its scales (Int4Tiles::line): its 8 rows' bf16 (scale, zero) pairs
// (scale in each dword's low half) where PAIRS, else scales alone (zero 0).
template <bool PAIRS>
inline void half_line_scale_zero(const at::BFloat16* line, int h, __m256& scale, __m256& zero) {
  if constexpr (PAIRS) {
    const __m256i s_z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 16 * h));
    scale = _mm256_castsi256_ps(_mm256_slli_epi32(s_z, 16));
    zero = _mm256_castsi256_ps(_mm256_and_si256(s_z, _mm256_set1_epi32(0xFFFF0000)));
  } else {
    scale = bf16x8_to_f32(line + 8 * h);
    zero = _mm256_setzero_ps();
  }
}

// Tile half h's (scale, zero) in group g.
inline void half_scale_zero(const Int4Tiles& w, int64_t tile, int64_t g, int h, __m256& scale, __m256& zero) {
  if (w.pairs) return half_line_scale_zero<true>(w.line(tile, g), h, scale, zero);
  half_line_scale_zero<false>(w.line(tile, g), h, scale, zero);
}

// M rows of a tile's 16 outputs (two halves of 8), rounded to bf16.
template <int M>
inline void store_tile(const __m256 acc[M][2], at::BFloat16* out, int64_t n_total, int64_t tile) {
  for (int m = 0; m < M; ++m) {
    alignas(32) float values[TILE];
    _mm256_store_ps(values, acc[m][0]);
    _mm256_store_ps(values + 8, acc[m][1]);
    for (int r = 0; r < TILE; ++r) out[m * n_total + tile * TILE + r] = at::BFloat16(values[r]);
  }
}

template <int M>
void int4_tile(const float* x, const float* xsum, const Int4Tiles& w, int64_t tile, at::BFloat16* out,
               int64_t n_total) {
  const int64_t k = w.k(), groups = w.groups, chunks_per_group = w.chunks_per_group();
  const __m256i nibble = _mm256_set1_epi32(0x000F0000), one = _mm256_set1_epi32(0x3F800000);
  __m256 acc[M][2];
  UNROLLED for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 dot[M][2][2];  // [x row][half][even/odd slot]: independent dependency chains
    UNROLLED for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) dot[m][h][0] = dot[m][h][1] = _mm256_setzero_ps();
    const int32_t* words = w.words(tile, g);
    for (int64_t i = 0, c = g * chunks_per_group; i < chunks_per_group; ++i, ++c) {
      prefetch<PREFETCH_INT4>(reinterpret_cast<const char*>(words + i * TILE) + PREFETCH_BYTES, M);
      const __m256i q[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + i * TILE)),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + i * TILE + 8))};
      for (int s = 0; s < 8; ++s) {
        __m256 v[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i at_16 = s < 4 ? _mm256_slli_epi32(q[h], 16 - 4 * s)
                                      : s == 4 ? q[h] : _mm256_srli_epi32(q[h], 4 * s - 16);
          v[h] = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(at_16, nibble), one));
        }
        UNROLLED for (int m = 0; m < M; ++m) {
          const __m256 xv = _mm256_broadcast_ss(x + m * k + c * 8 + ORDER[s]);
          for (int h = 0; h < 2; ++h) dot[m][h][s & 1] = _mm256_fmadd_ps(v[h], xv, dot[m][h][s & 1]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scale, zero;
      half_scale_zero(w, tile, g, h, scale, zero);
      const __m256 offset = _mm256_fnmadd_ps(scale, _mm256_set1_ps(136.0f), zero);
      const __m256 dot_scale = _mm256_mul_ps(scale, _mm256_set1_ps(128.0f));
      UNROLLED for (int m = 0; m < M; ++m) {
        acc[m][h] = _mm256_fmadd_ps(_mm256_add_ps(dot[m][h][0], dot[m][h][1]), dot_scale, acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum[m * groups + g]), acc[m][h]);
      }
    }
  }
  store_tile<M>(acc, out, n_total, tile);
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& w, int64_t group) {
  const Int4Tiles wt(w, group);
  const int64_t tiles = w.size(0), k = wt.k(), m = x.size(0), n = tiles * TILE;
  const at::Tensor xf = to_float(x);
  const float* xp = xf.data_ptr<float>();
  const std::vector<float> xsum = group_sums(xp, m, k, group);
  auto out = kernel_output({m, n}, x.options());
  const float* sp = xsum.data();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t groups = wt.groups;
  parallel_units(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for_x_chunks<X_ROWS>(m, [&](auto m_c, int64_t m0) {
        int4_tile<decltype(m_c)::value>(xp + m0 * k, sp + m0 * groups, wt, t, op + m0 * n, n);
      });
  });
  return out;
}

// ---- int4 x int8 dot products (vpmaddubsw) --------------------------------------------------------------------
// int4_dot_gemv's arithmetic on AVX2: the same int8 rows (int4_dot_activations) and, per block and group, the same
// float steps in the same order as the AVX-512 kernel, so both levels give the same result. A tile is two halves of 8
// rows, one dword lane per row. A tile word masked with 0x0F gives a row's columns 0, 4, 1, 5 of its chunk as unsigned
// bytes, shifted by 4 its columns 2, 6, 3, 7; vpmaddubsw multiplies them with x's signed bytes in the same order
// (broadcast to the 8 rows) into 16-bit pair sums. No step saturates: a pair is at most 2 * 15 * 127 = 3810 in
// magnitude (nibbles 0..15, x in -127..127), and a block's 8 pair sums per 16-bit lane (4 chunks, low and high
// nibbles) at most 8 * 3810 = 30480 < 2^15, so they add in 16 bits and one vpmaddwd with ones per block widens each
// row's two 16-bit lanes to its int32 block sum.

// M rows of T tiles' outputs (tiles first + t * step, two halves of 8 each), rounded to bf16.
template <int M, int T>
inline void store_tiles(const __m256 (&acc)[M][T][2], at::BFloat16* out, int64_t n_total, int64_t first,
                        int64_t step) {
  UNROLLED for (int t = 0; t < T; ++t) {
    __m256 tile_acc[M][2];
    UNROLLED for (int m = 0; m < M; ++m) tile_acc[m][0] = acc[m][t][0], tile_acc[m][1] = acc[m][t][1];
    store_tile<M>(tile_acc, out, n_total, first + t * step);
  }
}

// Block b's sums for M rows of x (row m's nibble-ordered pairs at x + m * row_stride) and T tiles (the block's chunk
// words in tile t at words[t]), per half of 8 rows: sums[m][t][h], 16-bit pair sums (with VNNI int32 sums) of code * q.
template <bool VNNI, int M, int T>
inline void int4_block_sums(const int32_t* const (&words)[T], const int32_t* x, int64_t row_stride, int64_t b,
                            __m256i (&sums)[M][T][2]) {
  const __m256i nibbles = _mm256_set1_epi8(0x0F);
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int t = 0; t < T; ++t) sums[m][t][0] = sums[m][t][1] = _mm256_setzero_si256();
  UNROLLED for (int i = 0; i < 4; ++i) {
    const int64_t c = b * 4 + i;
    UNROLLED for (int t = 0; t < T; ++t) {
      prefetch<PREFETCH_INT4>(reinterpret_cast<const char*>(words[t] + i * TILE) + PREFETCH_BYTES, M);
      UNROLLED for (int h = 0; h < 2; ++h) {
        const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words[t] + i * TILE + 8 * h));
        const __m256i low = _mm256_and_si256(half, nibbles);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi32(half, 4), nibbles);
        UNROLLED for (int m = 0; m < M; ++m) {
          const int32_t* xp = x + m * row_stride + c * 2;
          const __m256i x_low = _mm256_set1_epi32(xp[0]), x_high = _mm256_set1_epi32(xp[1]);
          __m256i& sum = sums[m][t][h];
          if constexpr (VNNI) {
            sum = dpbusd_avx(dpbusd_avx(sum, low, x_low), high, x_high);
          } else {
            sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(low, x_low));
            sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(high, x_high));
          }
        }
      }
    }
  }
}

// A block's exact sum of (code - 8) * q for one row, tile and half, in float: its sums widened to int32 (one vpmaddwd
// with ones without VNNI) plus the row's block offset (-8 * sum(q_b)).
template <bool VNNI>
inline __m256 int4_block_dot(__m256i sums, int32_t offset) {
  const __m256i block = VNNI ? sums : _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(block, _mm256_set1_epi32(offset)));
}

template <bool VNNI, int M, int T>  // T tiles at once: first + i * step (for_spans)
void int4_dot_tiles(const Int4DotActivations& a, int64_t m0, const Int4Tiles& w, int64_t first, int64_t step,
                    at::BFloat16* out, int64_t n_total) {
  const int64_t k = w.k(), chunks = k / 8, groups = w.groups, blocks = k / DOT_BLOCK;
  const int64_t blocks_per_group = w.group / DOT_BLOCK;
  __m256 acc[M][T][2];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int t = 0; t < T; ++t) acc[m][t][0] = acc[m][t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 dots[M][T][2];
    UNROLLED for (int m = 0; m < M; ++m)
      UNROLLED for (int t = 0; t < T; ++t) dots[m][t][0] = dots[m][t][1] = _mm256_setzero_ps();
    for (int64_t i = 0, b = g * blocks_per_group; i < blocks_per_group; ++i, ++b) {
      const int32_t* words[T];
      UNROLLED for (int t = 0; t < T; ++t) words[t] = w.words(first + t * step, g) + i * 4 * TILE;
      __m256i sums[M][T][2];  // [x row][tile][half]
      int4_block_sums<VNNI, M, T>(words, a.pairs.data() + m0 * chunks * 2, chunks * 2, b, sums);
      UNROLLED for (int m = 0; m < M; ++m) {
        const __m256 d = _mm256_set1_ps(a.d[(m0 + m) * blocks + b]);
        const int32_t offset = a.offsets[(m0 + m) * blocks + b];
        UNROLLED for (int t = 0; t < T; ++t)
          UNROLLED for (int h = 0; h < 2; ++h)
            dots[m][t][h] = _mm256_fmadd_ps(int4_block_dot<VNNI>(sums[m][t][h], offset), d, dots[m][t][h]);
      }
    }
    UNROLLED for (int t = 0; t < T; ++t)
      UNROLLED for (int h = 0; h < 2; ++h) {
        __m256 scale, zero;
        half_scale_zero(w, first + t * step, g, h, scale, zero);
        UNROLLED for (int m = 0; m < M; ++m) acc[m][t][h] = _mm256_fmadd_ps(dots[m][t][h], scale, acc[m][t][h]);
        if (w.pairs) {
          UNROLLED for (int m = 0; m < M; ++m)
            acc[m][t][h] = _mm256_fmadd_ps(zero, _mm256_set1_ps(a.sums[(m0 + m) * groups + g]), acc[m][t][h]);
        }
      }
  }
  store_tiles<M, T>(acc, out, n_total, first, step);
}

// int4_dot_tiles where every group is one block (group == DOT_BLOCK): the same steps in the same order, so the same
// bits, without the group loop around the block loop; streams and rows are walked by the block index, and whether the
// scales come with zeros is fixed at compile time (as the AVX-512 kernel's int4_dot_blocks).
template <bool VNNI, int M, int T, bool PAIRS>
void int4_dot_blocks(const Int4DotActivations& a, int64_t m0, const Int4Tiles& w, int64_t first, int64_t step,
                     at::BFloat16* out, int64_t n_total) {
  const int64_t chunks = w.k() / 8, blocks = w.k() / DOT_BLOCK;
  const Int4BlockWalk<T> walk(a, m0, w, first, step);
  __m256 acc[M][T][2];
  UNROLLED for (int m = 0; m < M; ++m)
    UNROLLED for (int t = 0; t < T; ++t) acc[m][t][0] = acc[m][t][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int32_t* words[T];
    walk.blocks(b, words);
    __m256i sums[M][T][2];  // [x row][tile][half]
    int4_block_sums<VNNI, M, T>(words, walk.x, chunks * 2, b, sums);
    UNROLLED for (int t = 0; t < T; ++t)
      UNROLLED for (int h = 0; h < 2; ++h) {
        __m256 scale, zero;
        half_line_scale_zero<PAIRS>(walk.line(t, b), h, scale, zero);
        UNROLLED for (int m = 0; m < M; ++m) {
          const __m256 dots = _mm256_fmadd_ps(int4_block_dot<VNNI>(sums[m][t][h], walk.offsets[m * blocks + b]),
                                              _mm256_set1_ps(walk.d[m * blocks + b]), _mm256_setzero_ps());
          acc[m][t][h] = _mm256_fmadd_ps(dots, scale, acc[m][t][h]);
          if constexpr (PAIRS)
            acc[m][t][h] = _mm256_fmadd_ps(zero, _mm256_set1_ps(walk.x_sums[m * blocks + b]), acc[m][t][h]);
        }
      }
  }
  store_tiles<M, T>(acc, out, n_total, first, step);
}

template <bool VNNI>
at::Tensor int4_dot_gemv(const at::Tensor& x, const at::Tensor& w, int64_t group) {
  const Int4Tiles wt(w, group);
  const int64_t tiles = w.size(0), k = wt.k(), m = x.size(0), n = tiles * TILE;
  const DotRows rows = round_rows(x.data_ptr<at::BFloat16>(), m, k);
  Int4DotActivations& a = rounded_for_int4;
  int4_dot_activations(rows.q.data(), k, rows.d.data(), m, k, group, a);
  auto out = kernel_output({m, n}, x.options());
  auto* op = out.data_ptr<at::BFloat16>();
  parallel_streams(tiles, m, [&](auto t_c, int64_t first, int64_t step) {
    constexpr int T = decltype(t_c)::value;
    for_x_chunks<MAX_ROWS / T>(m, [&](auto m_c, int64_t m0) {  // 4 rows x 1 tile: 8 sums in the 16 registers
      constexpr int M = decltype(m_c)::value;
      if (group != DOT_BLOCK) int4_dot_tiles<VNNI, M, T>(a, m0, wt, first, step, op + m0 * n, n);
      else if (wt.pairs) int4_dot_blocks<VNNI, M, T, true>(a, m0, wt, first, step, op + m0 * n, n);
      else int4_dot_blocks<VNNI, M, T, false>(a, m0, wt, first, step, op + m0 * n, n);
    });
  });
  return out;
}

// ---- conversions for prefill (exactly the AVX-512 results: every int8 is a bf16; (q - 8) * scale is exact in
// float32, so the one rounding of the sum and the round-to-nearest-even to bf16 match) ----------------------------
void int8_to_bf16_into(const int8_t* src, int64_t numel, at::BFloat16* dst) {
  at::parallel_for(0, numel, 1 << 16, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {  // int8 -> int16 -> top half of float32 bits is the bf16 of the same value
      const __m256 lo = int8x8_to_f32(src + i), hi = int8x8_to_f32(src + i + 8);
      const __m256i bits = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(lo), 16),
                                               _mm256_srli_epi32(_mm256_castps_si256(hi), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permute4x64_epi64(bits, 0xD8));
    }
    for (; i < end; ++i) dst[i] = at::BFloat16(static_cast<float>(src[i]));
  });
}

// 8 floats' bits with half a bf16 step added (ties to even): their upper 16 bits are the nearest bf16s (as at::BFloat16
// and the AVX-512 conversion round finite values).
inline __m256i bf16_rounding(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}

// 8 floats -> 8 bf16, rounded to nearest even.
inline __m128i f32x8_to_bf16(__m256 v) {
  const __m256i rounded = _mm256_srli_epi32(bf16_rounding(v), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

// 8 floats rounded to the nearest bf16, as floats.
inline __m256 f32x8_rounded(__m256 v) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_rounding(v), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// One tile row's chunk (8 columns) at a time: the word broadcast to 8 lanes, each lane shifted to its column's
// nibble (column j sits in slot ORDER^-1[j]), then (q - 8) * scale + zero in float32 and rounded to bf16.
void int4_dequantize_tile(const Int4Tiles& w, int64_t tile, at::BFloat16* out) {  // out: the tile's first row
  const int64_t k = w.k(), groups = w.groups, chunks_per_group = w.chunks_per_group();
  const __m256i shifts = _mm256_setr_epi32(0, 16, 4, 20, 8, 24, 12, 28), nibble = _mm256_set1_epi32(15);
  const __m256i eight = _mm256_set1_epi32(8);
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t* words = w.words(tile, g);
    for (int r = 0; r < TILE; ++r) {
      const __m256 scale = _mm256_set1_ps(w.scale(tile, g, r)), zero = _mm256_set1_ps(w.zero(tile, g, r));
      at::BFloat16* row = out + r * k + g * w.group;
      for (int64_t c = 0; c < chunks_per_group; ++c) {
        const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(words[c * TILE + r]), shifts), nibble);
        const __m256 value = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, eight)), scale, zero);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + c * 8), f32x8_to_bf16(value));
      }
    }
  }
}

// Tiles first .. end - 1 into out (row-major bf16, from the first tile's first row).
void int4_dequantize_into(const at::Tensor& w, int64_t group, int64_t first, int64_t end, at::BFloat16* out) {
  const Int4Tiles wt(w, group);
  at::parallel_for(first, end, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t t = begin; t < stop; ++t) int4_dequantize_tile(wt, t, out + (t - first) * TILE * wt.k());
  });
}

// ---- bandwidth probe -----------------------------------------------------------------------------------------------
// Reads every byte of p[0, bytes) once: the buffer as S sequential streams side by side (bytes / S apart), each
// thread reading its part of every stream, with a software prefetch ahead or none. Which pattern reads fastest
// differs between CPUs (four streams a power of two apart alias on some; one stream without prefetch is the fastest
// there), so the probe times several. Returns a checksum so the reads stay.
constexpr int64_t STREAMS = 4;  // the most streams: bytes must be whole blocks of STREAMS lines
template <int64_t S>
uint64_t stream_read(const uint8_t* p, int64_t bytes, bool ahead) {
  std::atomic<uint64_t> total{0};
  const int64_t lines = bytes / 64;
  at::parallel_for(0, lines / S, 1 << 10, [&](int64_t begin, int64_t end) {
    const int64_t part = end - begin;
    __m256i acc[S];
    for (auto& a : acc) a = _mm256_setzero_si256();
    for (int64_t line = 0; line < part; ++line)
      for (int64_t s = 0; s < S; ++s) {
        const uint8_t* q = p + ((s * (lines / S)) + begin + line) * 64;
        // the probe's own choice, whatever the kernels' software_prefetch setting
        if (ahead) prefetch_line<_MM_HINT_T0>(q + PREFETCH_BYTES);
        acc[s] = _mm256_xor_si256(acc[s], _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(q)),
                                                           _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 32))));
      }
    __m256i all = acc[0];
    for (int64_t s = 1; s < S; ++s) all = _mm256_xor_si256(all, acc[s]);
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), all);
    total ^= lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
  });
  return total.load();
}

// ---- attention for one query per row (decode): avx512::attend_part's steps, 8 lanes ------------------------------
inline __m256 load_f32x8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_f32x8(const at::BFloat16* p) { return bf16x8_to_f32(p); }

inline __m256 exp_scores(__m256 x) {  // as avx512::exp_scores
  const __m256 clamped = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
  return _mm256_andnot_ps(masked, _mm256_mul_ps(y, _mm256_castsi256_ps(two_n)));
}

// 8 scores from s, the lanes past the end read as -inf.
inline __m256 load_scores(const float* s, int64_t left) {
  if (left >= 8) return _mm256_loadu_ps(s);
  alignas(32) float tail[8];
  for (int64_t i = 0; i < 8; ++i) tail[i] = i < left ? s[i] : -INFINITY;
  return _mm256_load_ps(tail);
}

// avx512::key_dots with vectors of 8 floats.
template <int KEYS>
inline void key_dots(const float* q, const float* keys, int64_t stride, int64_t keys_here, int64_t vectors,
                     __m256 (&dots)[KEYS]) {
  for (int i = 0; i < KEYS; ++i) dots[i] = _mm256_setzero_ps();
  if (keys_here == KEYS) {
    for (int64_t c = 0; c < vectors; ++c) {
      const __m256 qv = _mm256_loadu_ps(q + 8 * c);
      for (int i = 0; i < KEYS; ++i)
        dots[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + i * stride + 8 * c), dots[i]);
    }
    return;
  }
  for (int64_t i = 0; i < keys_here; ++i)  // the last, partial block
    for (int64_t c = 0; c < vectors; ++c)
      dots[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(keys + i * stride + 8 * c), dots[i]);
}

// Lane i: the sum of v[i]'s lanes (avx512::sum16's tree for 8).
inline __m256 sum8(const __m256 (&v)[8]) {
  __m256 x[4], y[2];
  for (int i = 0; i < 4; ++i)
    x[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(x[2 * i]), b = _mm256_castps_pd(x[2 * i + 1]);
    y[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20), _mm256_permute2f128_ps(y[0], y[1], 0x31));
}

inline void widen_row(const at::BFloat16* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(dst + i, load_f32x8(src + i));
}

// Lanes i whose bit i is set in bits, as all-ones lanes.
inline __m256 lanes_of(uint32_t bits) {
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bits),
                                                lane_bits));
}

// Stores the first min(left, 8) lanes of v at p.
inline void store_lanes(float* p, __m256 v, int64_t left) {
  if (left >= 8) return _mm256_storeu_ps(p, v);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  std::copy(lanes, lanes + left, p);
}

// Head q's scores q . k * scale of the part's keys j0 .. j0 + here (rows at keys, stride apart; j0 a multiple of 8)
// into s[j0 ..], -inf for keys not visible; top: the largest score so far, raised to this block's.
inline void block_scores(const float* q, const float* keys, int64_t stride, int64_t j0, int64_t here,
                         int64_t halves, float scale, const uint32_t* seen_bits, float* s, float& top) {
  __m256 best = _mm256_set1_ps(top);
  for (int64_t j = 0; j < here; j += 8) {
    const uint32_t seen = seen_bits[(j0 + j) / 16] >> ((j0 + j) % 16) & 0xFF;
    __m256 block = _mm256_set1_ps(-INFINITY);
    if (seen) {
      __m256 dots[8];
      key_dots<8>(q, keys + j * stride, stride, std::min<int64_t>(8, here - j), halves, dots);
      block = _mm256_blendv_ps(block, _mm256_mul_ps(sum8(dots), _mm256_set1_ps(scale)), lanes_of(seen));
    }
    store_lanes(s + j0 + j, block, here - j);
    best = _mm256_max_ps(best, block);
  }
  top = horizontal_max(best);
}

// e^(s[j] - m) in place for the n scores of one head, the largest m (-inf: no key visible, every weight 0); returns
// their sum.
inline float exponentials(float* s, int64_t n, float m) {
  if (m == -INFINITY) {
    std::fill(s, s + n, 0.f);
    return 0.f;
  }
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 p = exp_scores(_mm256_sub_ps(load_scores(s + j, n - j), _mm256_set1_ps(m)));
    total = _mm256_add_ps(total, p);
    store_lanes(s + j, p, n - j);
  }
  return horizontal_sum(total);
}

// out[:8 * COLUMNS] += sum_j p[j] * values[j][:8 * COLUMNS] (COLUMNS = 0: count, given at run time, up to 8), keys of
// weight 0 skipped (so a masked slot's value, whatever it holds, adds nothing).
template <int64_t COLUMNS>
void add_weighted_values(const float* p, const float* values, int64_t stride, int64_t n, int64_t count, float* out) {
  if constexpr (COLUMNS > 0) count = COLUMNS;
  __m256 acc[COLUMNS > 0 ? COLUMNS : 8];
  for (int64_t c = 0; c < count; ++c) acc[c] = _mm256_loadu_ps(out + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] == 0.f) continue;
    const __m256 w = _mm256_set1_ps(p[j]);
    for (int64_t c = 0; c < count; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values + j * stride + 8 * c), acc[c]);
  }
  for (int64_t c = 0; c < count; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

// add_weighted_values over a head's d columns, 64 at a time (the accumulators of more would not fit the 16 registers).
inline void add_weighted_values(const float* p, const float* values, int64_t stride, int64_t n, int64_t d,
                                float* out) {
  for (int64_t c = 0; c < d; c += 64) {
    const int64_t count = std::min<int64_t>(64, d - c) / 8;
    if (count == 8) add_weighted_values<8>(p, values + c, stride, n, count, out + c);
    else if (count == 4) add_weighted_values<4>(p, values + c, stride, n, count, out + c);
    else add_weighted_values<0>(p, values + c, stride, n, count, out + c);
  }
}

// avx512::attend_part's result with 8 lanes: every head's scores, block by block of keys (key_block); each head's
// softmax; then the weighted values, block by block of values. Each head's sums run over the keys in order, so the
// blocks change no bit of them.
template <typename T>
void attend_part(const AttentionPart<T>& a, AttentionScratch& scratch) {
  const int64_t d = a.dim, n = a.keys, block = key_block(d, 8);
  part_queries(a, scratch);
  float* scores = scratch.scores.data();
  for (int64_t h = 0; h < a.heads; ++h) a.out[h * (d + 2) + d] = -INFINITY;  // each head's largest score so far
  for (int64_t j0 = 0; j0 < n; j0 += block) {
    const int64_t here = std::min(block, n - j0);
    int64_t stride = a.k_stride;
    const float* keys = rows_as_float(a.k + j0 * a.k_stride, stride, here, d, scratch.keys, widen_row);
    for (int64_t h = 0; h < a.heads; ++h)
      block_scores(scratch.q.data() + h * d, keys, stride, j0, here, d / 8, a.scale, scratch.seen.data(),
                   scores + h * n, a.out[h * (d + 2) + d]);
  }
  for (int64_t h = 0; h < a.heads; ++h) {
    float* out = a.out + h * (d + 2);
    out[d + 1] = exponentials(scores + h * n, n, out[d]);
    std::fill(out, out + d, 0.f);
  }
  for (int64_t j0 = 0; j0 < n; j0 += block) {
    const int64_t here = std::min(block, n - j0);
    int64_t stride = a.v_stride;
    const float* values = rows_as_float(a.v + j0 * a.v_stride, stride, here, d, scratch.values, widen_row);
    for (int64_t h = 0; h < a.heads; ++h)
      add_weighted_values(scores + h * n + j0, values, stride, here, d, a.out + h * (d + 2));
  }
}


// ---- the greedy pick --------------------------------------------------------------------------------------------------
// The index torch.max(x, -1) returns for one row of n values (float32, or bf16 read as the float32 values they are):
// the first index of the largest value, a NaN counting as larger than any number (the first NaN's). CHAINS x 8 lanes
// each keep their largest value so far and its first index (a strictly larger value replaces it; independent chains, so
// the compare-and-blend latency overlaps); then the largest of those, the smallest index among equal ones, and the tail
// element by element.
inline __m256 load_8_floats(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_8_floats(const at::BFloat16* p) { return bf16x8_to_f32(p); }

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  constexpr int CHAINS = 4, WIDTH = 8 * CHAINS;
  const auto scalar_from = [&](int64_t first, int64_t best) -> int64_t {  // from first on, best the best before it
    for (int64_t i = first; i < n; ++i) {
      const float value = static_cast<float>(x[i]);
      if (std::isnan(value)) return i;
      if (value > static_cast<float>(x[best])) best = i;
    }
    return best;
  };
  if (n < 2 * WIDTH) return scalar_from(0, 0);
  __m256 best[CHAINS], nan = _mm256_setzero_ps();
  __m256i best_at[CHAINS], at[CHAINS];
  for (int c = 0; c < CHAINS; ++c) {
    best[c] = load_8_floats(x + 8 * c);
    at[c] = best_at[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * c));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(best[c], best[c], _CMP_UNORD_Q));
  }
  int64_t i = WIDTH;
  for (; i + WIDTH <= n; i += WIDTH)
    for (int c = 0; c < CHAINS; ++c) {
      const __m256 v = load_8_floats(x + i + 8 * c);
      at[c] = _mm256_add_epi32(at[c], _mm256_set1_epi32(WIDTH));
      const __m256 larger = _mm256_cmp_ps(v, best[c], _CMP_GT_OQ);
      best[c] = _mm256_blendv_ps(best[c], v, larger);
      best_at[c] = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(best_at[c]), _mm256_castsi256_ps(at[c]), larger));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  if (_mm256_movemask_ps(nan)) return scalar_from(0, 0);  // rare: torch's NaN rule, element by element
  alignas(32) float value[WIDTH];
  alignas(32) int32_t index[WIDTH];
  for (int c = 0; c < CHAINS; ++c) {
    _mm256_store_ps(value + 8 * c, best[c]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(index + 8 * c), best_at[c]);
  }
  int64_t top = index[0];
  float top_value = value[0];
  for (int lane = 1; lane < WIDTH; ++lane)
    if (value[lane] > top_value || (value[lane] == top_value && index[lane] < top)) {
      top = index[lane];
      top_value = value[lane];
    }
  return scalar_from(i, top);
}


// ---- a decoder layer's elementwise work (decode_layers), 8 lanes: every level's CPU runs AVX2 -----------------------
// Each rounds to bf16 where the fused block's eager ops round (torch computes bf16 ops in float32, rounding each
// result once).

// r = 1 / sqrt(mean(x^2) + eps) of one row x [n] in float32.
float rms_scale(const at::BFloat16* x, int64_t n, float eps) {
  __m256 squares = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = bf16x8_to_f32(x + i);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  float total = horizontal_sum(squares);
  for (; i < n; ++i) total += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return 1.0f / std::sqrt(total / static_cast<float>(n) + eps);
}

// out = bf16(bf16(x * r) * w), r = rms_scale(x) (RMSNorm as splice.layers.norm rounds it).
void rms_norm_row(const at::BFloat16* x, const at::BFloat16* w, int64_t n, float eps, at::BFloat16* out) {
  const float r = rms_scale(x, n, eps);
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 normed = f32x8_rounded(_mm256_mul_ps(bf16x8_to_f32(x + i), rv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), f32x8_to_bf16(_mm256_mul_ps(normed, bf16x8_to_f32(w + i))));
  }
  for (; i < n; ++i) {
    const float normed = static_cast<float>(at::BFloat16(static_cast<float>(x[i]) * r));
    out[i] = at::BFloat16(normed * static_cast<float>(w[i]));
  }
}

// RMSNorm of one row x [n] with a float32 weight: out = bf16(x * r * w), r = rms_scale(x), the product in float32
// rounded once (as splice.layers.norm.RMSNorm scales with a float32 weight).
void rms_norm_row_float(const at::BFloat16* x, const float* w, int64_t n, float eps, at::BFloat16* out) {
  const float r = rms_scale(x, n, eps);
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 normed = _mm256_mul_ps(bf16x8_to_f32(x + i), rv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), f32x8_to_bf16(_mm256_mul_ps(normed, _mm256_loadu_ps(w + i))));
  }
  for (; i < n; ++i) out[i] = at::BFloat16(static_cast<float>(x[i]) * r * w[i]);
}

// LayerNorm of one row x [n] with a bf16 weight and bias (or none), as torch's LayerNorm of a bf16 row computes it:
// mean and variance in float32 (here the lanes' sums joined in double, so at most their last bits apart), rstd = 1 /
// sqrt(var + eps), then (x * rstd - mean * rstd) * w + b in float32, rounded once to bf16.
void layer_norm_row(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, int64_t n, float eps,
                    at::BFloat16* out) {
  __m256 sums = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) sums = _mm256_add_ps(sums, bf16x8_to_f32(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sums);
  double total = 0;
  for (float lane : lanes) total += lane;
  for (; i < n; ++i) total += static_cast<float>(x[i]);
  const float mean = static_cast<float>(total / static_cast<double>(n));
  __m256 squares = _mm256_setzero_ps();
  const __m256 mean_v = _mm256_set1_ps(mean);
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_sub_ps(bf16x8_to_f32(x + i), mean_v);
    squares = _mm256_fmadd_ps(d, d, squares);
  }
  _mm256_store_ps(lanes, squares);
  double square_total = 0;
  for (float lane : lanes) square_total += lane;
  for (; i < n; ++i) square_total += (static_cast<float>(x[i]) - mean) * (static_cast<float>(x[i]) - mean);
  const float rstd = 1.0f / std::sqrt(static_cast<float>(square_total / static_cast<double>(n)) + eps);
  const __m256 scale = _mm256_set1_ps(rstd), shift = _mm256_set1_ps(-mean * rstd);
  for (i = 0; i + 8 <= n; i += 8) {
    __m256 y = _mm256_mul_ps(_mm256_fmadd_ps(bf16x8_to_f32(x + i), scale, shift), bf16x8_to_f32(w + i));
    if (bias) y = _mm256_add_ps(y, bf16x8_to_f32(bias + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), f32x8_to_bf16(y));
  }
  for (; i < n; ++i) {
    float y = std::fma(static_cast<float>(x[i]), rstd, -mean * rstd) * static_cast<float>(w[i]);
    if (bias) y += static_cast<float>(bias[i]);
    out[i] = at::BFloat16(y);
  }
}

// x[0 .. rotary) = x * cos + rotate_half(x) * sin for one head, rounded as apply_rotary_ rounds it: each product to
// bf16, then their sum (sin carries rotate_half's sign). Eight lanes of each half at a time where the half is a
// multiple of 8.
void rotate_head(at::BFloat16* x, const at::BFloat16* cos, const at::BFloat16* sin, int64_t rotary) {
  const int64_t half = rotary / 2;
  if (half % 8 == 0) {
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 low = bf16x8_to_f32(x + i), high = bf16x8_to_f32(x + half + i);
      const __m256 new_low = _mm256_add_ps(f32x8_rounded(_mm256_mul_ps(low, bf16x8_to_f32(cos + i))),
                                           f32x8_rounded(_mm256_mul_ps(high, bf16x8_to_f32(sin + i))));
      const __m256 new_high = _mm256_add_ps(f32x8_rounded(_mm256_mul_ps(high, bf16x8_to_f32(cos + half + i))),
                                            f32x8_rounded(_mm256_mul_ps(low, bf16x8_to_f32(sin + half + i))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(x + i), f32x8_to_bf16(new_low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(x + half + i), f32x8_to_bf16(new_high));
    }
    return;
  }
  float original[MAX_HEAD_DIM];
  for (int64_t i = 0; i < rotary; ++i) original[i] = static_cast<float>(x[i]);
  for (int64_t i = 0; i < rotary; ++i) {
    const float rolled = original[i < half ? i + half : i - half];
    const float turned = static_cast<float>(at::BFloat16(rolled * static_cast<float>(sin[i])));
    const float kept = static_cast<float>(at::BFloat16(original[i] * static_cast<float>(cos[i])));
    x[i] = at::BFloat16(kept + turned);
  }
}

// out = bf16(a + b).
void add_row(const at::BFloat16* a, const at::BFloat16* b, int64_t n, at::BFloat16* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     f32x8_to_bf16(_mm256_add_ps(bf16x8_to_f32(a + i), bf16x8_to_f32(b + i))));
  for (; i < n; ++i) out[i] = at::BFloat16(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

// out = bf16(bf16(silu(gate)) * up), silu(g) = g / (1 + e^-g) (e^-g capped at e^88: the quotient is -0 either way,
// to within float's smallest normal).
void silu_mul_row(const at::BFloat16* gate, const at::BFloat16* up, int64_t n, at::BFloat16* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = bf16x8_to_f32(gate + i);
    const __m256 e = exp_scores(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(88.0f)));
    const __m256 silu = f32x8_rounded(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), f32x8_to_bf16(_mm256_mul_ps(silu, bf16x8_to_f32(up + i))));
  }
  for (; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    const float silu = static_cast<float>(at::BFloat16(g / (1.0f + std::exp(std::min(-g, 88.0f)))));
    out[i] = at::BFloat16(silu * static_cast<float>(up[i]));
  }
}

// An MLP's activations (splice.layers.block.ACTIVATIONS, gemv.cpp's MlpActivation) of 8 floats, in float32: SiLU
// x / (1 + e^-x); GELU (erf) x * (1 - erfc(x / sqrt 2) / 2) for x >= 0 and x * erfc(-x / sqrt 2) / 2 below, erfc
// from Numerical Recipes' Chebyshev fit (fractional error under 1.2e-7); the tanh GELU 0.5 x (1 + tanh(u)) as x / (1 +
// e^(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3); ReLU max(x, 0). torch's own approximations differ in the last bits
// of the float32, so the bf16 results agree but for a rare last-bit rounding.
inline __m256 sigmoid_times(__m256 x, __m256 z) {  // x / (1 + e^-z)
  const __m256 e = exp_scores(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), z), _mm256_set1_ps(88.0f)));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

inline __m256 erfc_positive(__m256 z) {  // erfc(z) for z >= 0
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_set1_ps(0.5f), z, _mm256_set1_ps(1.0f)));
  constexpr float c[10] = {-1.26551223f, 1.00002368f, 0.37409196f, 0.09678418f, -0.18628806f,
                           0.27886807f, -1.13520398f, 1.48851587f, -0.82215223f, 0.17087277f};
  __m256 poly = _mm256_set1_ps(c[9]);
  for (int j = 8; j >= 0; --j) poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(c[j]));
  const __m256 exponent = _mm256_sub_ps(poly, _mm256_mul_ps(z, z));
  return _mm256_mul_ps(t, exp_scores(_mm256_max_ps(exponent, _mm256_set1_ps(-100.0f))));
}

inline __m256 activation8(__m256 x, int64_t kind) {
  switch (kind) {
    case 1: {  // GELU
      const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
      const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
      const __m256 half_erfc = _mm256_mul_ps(_mm256_set1_ps(0.5f),
                                             erfc_positive(_mm256_mul_ps(magnitude, _mm256_set1_ps(0.70710678f))));
      const __m256 factor = _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), half_erfc), half_erfc, negative);
      return _mm256_mul_ps(x, factor);
    }
    case 2: {  // the tanh GELU
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      const __m256 inner = _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, x);
      const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f), inner);
      return sigmoid_times(x, _mm256_add_ps(u, u));
    }
    case 3: return _mm256_max_ps(x, _mm256_setzero_ps());  // ReLU
    default: return sigmoid_times(x, x);  // SiLU
  }
}

// act(h) of a plain MLP's row (up, n values) into out, each value in float32 rounded once to bf16 (as torch's
// activation of a bf16 tensor); or with `up` a gated MLP's bf16(bf16(act(gate)) * up), rounded as act(gate).mul_(up)
// rounds.
void activation_row(const at::BFloat16* h, const at::BFloat16* up, int64_t n, int64_t kind, at::BFloat16* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 value = activation8(bf16x8_to_f32(h + i), kind);
    if (up) value = _mm256_mul_ps(f32x8_rounded(value), bf16x8_to_f32(up + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), f32x8_to_bf16(value));
  }
  if (i == n) return;
  alignas(32) float tail_in[8] = {}, tail_up[8] = {}, tail_out[8];
  for (int64_t j = i; j < n; ++j) {
    tail_in[j - i] = static_cast<float>(h[j]);
    if (up) tail_up[j - i] = static_cast<float>(up[j]);
  }
  __m256 value = activation8(_mm256_load_ps(tail_in), kind);
  if (up) value = _mm256_mul_ps(f32x8_rounded(value), _mm256_load_ps(tail_up));
  _mm256_store_ps(tail_out, value);
  for (int64_t j = i; j < n; ++j) out[j] = at::BFloat16(tail_out[j - i]);
}

}  // namespace avx2
#pragma GCC pop_options

// Where the AMX paths start and stop, for reports: int4_gemv from AMX_MIN_ROWS rows and int4_dot_gemv from
// INT4_DOT_AMX_MIN_ROWS (groups a multiple of AMX_COLUMNS), int8_gemv from INT8_AMX_MIN_ROWS to AMX_ROWS rows
// (int8_dot_gemv never).
std::vector<int64_t> amx_thresholds() {
  return {avx512::AMX_MIN_ROWS, avx512::INT8_AMX_MIN_ROWS, avx512::AMX_ROWS, avx512::AMX_COLUMNS,
          avx512::INT4_DOT_AMX_MIN_ROWS};
}

// ---- the ops: checks, then the active level's kernel -----------------------------------------------------------------
// Attention of one query per row (q [B, H, 1, D]) over keys and values [B, KV, L, D] (any strides but the last; the
// H query heads in KV groups share their KV head), where mask [B or 1, 1, 1, L] (bool) is true; the output is
// [B, H, 1, D] in q's dtype. The keys split into parts so every thread has work even at one row and few KV heads;
// each part's max, sum and weighted values merge exactly.
// fewer keys than this per part cost more to merge than they save; 128 lets 256 slots over 3 KV heads (SmolLM2) make
// 6 units of work for 2 threads rather than 3
constexpr int64_t MIN_PART_KEYS = 128;
constexpr int64_t MIN_EVEN_PART_KEYS = 16;  // parts as small as this to share the units out evenly
constexpr int64_t MAX_PART_KEYS = 512;  // a part's widened keys and values stay in the core's L2 cache
constexpr int64_t MERGE_GRAIN = 1 << 14;

void check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "decode_attention: q must be [B, H, 1, D], got ", q.sizes());
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "decode_attention: k and v must be [B, KV, L, D] of one shape, "
              "got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "decode_attention: q ", q.sizes(), " does not fit k ", k.sizes(), " (same B and D, H a multiple of KV)");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
              k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "decode_attention: q, k and v must all be float32 or all bfloat16, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention: CPU tensors only");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: q, k and v must be contiguous in their last dimension");
  TORCH_CHECK(head_dim_fits(q.size(3)), "decode_attention: head_dim ", q.size(3),
              " is not a multiple of 16 up to ", MAX_HEAD_DIM);
  if (mask) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(1) == 1 && m.size(2) == 1 &&
                m.size(3) == k.size(2) && (m.size(0) == 1 || m.size(0) == q.size(0)),
                "decode_attention: mask must be bool [B or 1, 1, 1, ", k.size(2), "], got ", m.scalar_type(), " ",
                m.sizes());
  }
}

// decode_attention's inputs as pointers and strides: q [B, heads, 1, dim], keys and values [B, kv_heads, keys, dim],
// the mask bool [B or 1, 1, 1, keys] or none (mask_b 0: one row for every row).
template <typename T>
struct AttentionInputs {
  const T* q;
  int64_t q_b, q_h;
  const T* k;
  int64_t k_b, k_h, k_j;
  const T* v;
  int64_t v_b, v_h, v_j;
  const bool* mask;
  int64_t mask_b, mask_j;
  int64_t batch, heads, kv, keys, dim;
  float scale;
  const float* sinks = nullptr;  // a logit per query head that joins each row's softmax with no value, or none
};

// The queries given as `heads` heads of k's head_dim at q, a row q_b and a head q_h apart; the first `keys` slots of
// k and v attended.
template <typename T>
AttentionInputs<T> attention_inputs(const T* q, int64_t q_b, int64_t q_h, int64_t heads, const at::Tensor& k,
                                    const at::Tensor& v, int64_t keys, const std::optional<at::Tensor>& mask,
                                    double scale) {
  const bool* mp = mask ? mask->data_ptr<bool>() : nullptr;
  return {q, q_b, q_h, k.data_ptr<T>(), k.stride(0), k.stride(1), k.stride(2), v.data_ptr<T>(), v.stride(0),
          v.stride(1), v.stride(2), mp, mask && mask->size(0) > 1 ? mask->stride(0) : 0, mask ? mask->stride(3) : 1,
          k.size(0), heads, k.size(1), keys, k.size(3), static_cast<float>(scale)};
}

// How many parts decode_attention splits each row's keys into (every (row, KV head) a unit per part) for `threads`:
// enough for every thread to have work, parts of MIN_PART_KEYS to MAX_PART_KEYS keys; then, where the units do not
// share out evenly (3 KV heads on 2 threads: one thread would attend twice as long as the other, which waits), the
// next count that does, while its parts keep MIN_EVEN_PART_KEYS keys.
int64_t attention_parts(int64_t batch, int64_t kv, int64_t keys, int64_t threads) {
  const int64_t parts = std::max((keys + MAX_PART_KEYS - 1) / MAX_PART_KEYS,
                                 std::clamp<int64_t>((2 * threads + batch * kv - 1) / (batch * kv), 1,
                                                     std::max<int64_t>(1, keys / MIN_PART_KEYS)));
  for (int64_t even = parts; even < parts + threads && keys / even >= MIN_EVEN_PART_KEYS; ++even)
    if (batch * kv * even % threads == 0) return even;
  return parts;
}

// The floats attend_into's partial sums take: per (row, query head, part) the head's weighted sum, top score and sum.
int64_t attention_partial_floats(int64_t batch, int64_t heads, int64_t dim, int64_t parts) {
  return batch * heads * parts * (dim + 2);
}

// decode_attention into out [B, heads, 1, dim] (contiguous): each (row, KV head, part) of the keys attended into
// partial, then the parts merged (in a team, each thread its share of both; out complete at the team's next barrier).
template <typename T>
void attend_into(const AttentionInputs<T>& in, int64_t parts, float* partial, T* op) {
  const int64_t batch = in.batch, heads = in.heads, dim = in.dim, kv = in.kv, keys = in.keys, group = heads / kv;
  const int64_t part_keys = (keys + parts - 1) / parts, units = batch * kv * parts, row = dim + 2;
  parallel_units(0, units, 1, [&](int64_t begin, int64_t end) {
    // kept per thread between calls: fresh buffers would be allocated and zero-filled for every layer of every step
    thread_local AttentionScratch scratch;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / (kv * parts), h = u / parts % kv, first = u % parts * part_keys;
      AttentionPart<T> a{in.q + b * in.q_b + h * group * in.q_h, in.q_h,
                         in.k + b * in.k_b + h * in.k_h + first * in.k_j,
                         in.v + b * in.v_b + h * in.v_h + first * in.v_j, in.k_j, in.v_j,
                         nullptr, 0, std::max<int64_t>(0, std::min(part_keys, keys - first)), dim, group,
                         in.scale, partial + u * group * row};
      if (in.mask) {
        a.visible = in.mask + b * in.mask_b + first * in.mask_j;
        a.visible_stride = in.mask_j;
      }
      if (isa() >= ISA_AVX512) avx512::attend_part(a, scratch);
      else avx2::attend_part(a, scratch);
    }
  });
  team_barrier();  // in a team, the merge reads parts other threads wrote
  // the merge reads parts * dim floats a head: below MERGE_GRAIN of them in all, waking the threads costs more
  const int64_t grain = std::max<int64_t>(1, MERGE_GRAIN / (parts * dim));
  parallel_units(0, batch * heads, grain, [&](int64_t begin, int64_t end) {
    float sum[MAX_HEAD_DIM];
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const float* first = partial + ((b * kv + h / group) * parts * group + h % group) * row;
      float top = in.sinks ? in.sinks[h] : -INFINITY, total = 0.f;
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, first[p * group * row + dim]);
      if (in.sinks) total = std::exp(in.sinks[h] - top);  // the sink's share: a weight with no value
      std::fill(sum, sum + dim, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const float* part = first + p * group * row;
        if (part[dim] == -INFINITY) continue;
        const float weight = std::exp(part[dim] - top);
        total += weight * part[dim + 1];
        for (int64_t i = 0; i < dim; ++i) sum[i] += weight * part[i];
      }
      for (int64_t i = 0; i < dim; ++i) op[bh * dim + i] = static_cast<T>(sum[i] / total);
    }
  });
}

template <typename T>
at::Tensor decode_attention_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& mask, double scale,
                               const std::optional<at::Tensor>& sinks) {
  AttentionInputs<T> in =
      attention_inputs<T>(q.data_ptr<T>(), q.stride(0), q.stride(1), q.size(1), k, v, k.size(2), mask, scale);
  if (sinks) in.sinks = sinks->data_ptr<float>();
  const int64_t parts = attention_parts(in.batch, in.kv, in.keys, at::get_num_threads());
  std::vector<float> partial(attention_partial_floats(in.batch, in.heads, in.dim, parts));
  const at::Tensor out = at::empty({in.batch, in.heads, 1, in.dim}, q.options());
  attend_into<T>(in, parts, partial.data(), out.data_ptr<T>());
  return out;
}

// Greedy decoding's pick: argmax_rows(x float32 or bf16 [B, V]) -> int64 [B], torch.max(x, -1).indices
// (avx2::argmax_row: every level's CPU runs AVX2). torch's own reduction over a vocabulary steps one element at a time.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_isa("argmax_rows");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || bf16) && x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: x must be a contiguous float32 or bf16 [rows, columns] with columns > 0, got ",
              x.scalar_type(), " ", x.sizes(), x.is_contiguous() ? "" : " (not contiguous)");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.size(1);
  for (int64_t row = 0; row < x.size(0); ++row)
    op[row] = bf16 ? avx2::argmax_row(x.data_ptr<at::BFloat16>() + row * n, n)
                   : avx2::argmax_row(x.data_ptr<float>() + row * n, n);
  return out;
}

// A greedy decoding step's token bookkeeping in one call: each row's pick (argmax_rows), pad where the row had
// finished (unfinished [B] int64, 0 for a finished row), written into sequences [B, L] int64 at `column`; a row whose
// token is one of eos (int64 ids, or none) is marked finished. Returns the tokens [B] and the rows still unfinished.
// generate's loop made eight torch calls of this, each slow to start after a step has streamed its weights through
// the caches.
std::tuple<at::Tensor, int64_t> greedy_next(const at::Tensor& logits, at::Tensor& sequences, int64_t column,
                                            at::Tensor& unfinished, const std::optional<at::Tensor>& eos, int64_t pad) {
  const at::Tensor tokens = argmax_rows(logits);
  const int64_t rows = logits.size(0);
  TORCH_CHECK(sequences.dim() == 2 && sequences.size(0) == rows && sequences.scalar_type() == at::kLong &&
                  sequences.is_contiguous() && 0 <= column && column < sequences.size(1),
              "greedy_next: sequences must be contiguous int64 [", rows, ", L] with column ", column, " inside, got ",
              sequences.scalar_type(), " ", sequences.sizes());
  TORCH_CHECK(unfinished.dim() == 1 && unfinished.size(0) == rows && unfinished.scalar_type() == at::kLong &&
                  unfinished.is_contiguous(),
              "greedy_next: unfinished must be contiguous int64 [", rows, "], got ", unfinished.scalar_type(), " ",
              unfinished.sizes());
  TORCH_CHECK(!eos || (eos->dim() == 1 && eos->scalar_type() == at::kLong && eos->is_contiguous()),
              "greedy_next: eos must be contiguous int64 ids [n], got ", eos ? eos->scalar_type() : at::kLong, " ",
              eos ? eos->sizes() : at::IntArrayRef());
  int64_t* tp = tokens.data_ptr<int64_t>();
  int64_t* sp = sequences.data_ptr<int64_t>();
  int64_t* up = unfinished.data_ptr<int64_t>();
  const int64_t* ep = eos ? eos->data_ptr<int64_t>() : nullptr;
  const int64_t eos_count = eos ? eos->numel() : 0, length = sequences.size(1);
  int64_t running = 0;
  for (int64_t row = 0; row < rows; ++row) {
    if (eos && up[row] == 0) tp[row] = pad;
    if (std::find(ep, ep + eos_count, tp[row]) != ep + eos_count) up[row] = 0;
    sp[row * length + column] = tp[row];
    running += up[row] != 0;
  }
  return {tokens, running};
}

// Attention sinks: float32 [heads], a logit per query head that joins each row's softmax with no value (GPT-OSS).
void check_sinks(const std::optional<at::Tensor>& sinks, int64_t heads, const char* op) {
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == heads &&
                         sinks->is_contiguous()),
              op, ": sinks must be contiguous float32 [", heads, "] (a logit per query head), got ",
              sinks ? sinks->scalar_type() : at::kFloat, " ", sinks ? sinks->sizes() : at::IntArrayRef());
}

at::Tensor decode_attention_with(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::optional<at::Tensor>& mask, double scale,
                                 const std::optional<at::Tensor>& sinks, const char* op) {
  check_isa(op);
  check_attention(q, k, v, mask);
  check_sinks(sinks, q.size(1), op);
  return q.scalar_type() == at::kFloat ? decode_attention_of<float>(q, k, v, mask, scale, sinks)
                                       : decode_attention_of<at::BFloat16>(q, k, v, mask, scale, sinks);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, double scale) {
  return decode_attention_with(q, k, v, mask, scale, std::nullopt, "decode_attention");
}

// decode_attention with attention sinks (check_sinks): an op of its own, so every call passes every argument (a
// compiled step's C++ wrapper calls an op with the arguments the graph gives it, leaving out defaulted ones).
at::Tensor decode_attention_sinks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& mask, double scale, const at::Tensor& sinks) {
  return decode_attention_with(q, k, v, mask, scale, sinks, "decode_attention_sinks");
}
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w) {
  check_isa("bf16_gemv");
  check_bf16_weight(w, "bf16_gemv");
  check_rows(x, w.size(1), "bf16_gemv");
  return isa() >= ISA_AVX512 ? avx512::bf16_gemv(x, w) : avx2::bf16_gemv(x, w);
}

// ---- int8 dword tiles (avx512::int8_dot_tiles' layout) -------------------------------------------------------------
// Calls f(offset of a byte in the tiles, offset of the same weight byte in rows) for every byte of an [n, k] weight.
template <typename F>
void for_tile_bytes(int64_t n, int64_t k, F&& f) {
  constexpr int64_t R = avx512::TRANSPOSED_WEIGHT_ROWS;
  const int64_t whole = avx512::whole_tile_rows(n);
  at::parallel_for(0, whole / R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t c = 0; c < k; c += avx512::DOT_STEP) {
        const int64_t step = g * R * k + c * R, dwords = std::min<int64_t>(avx512::DOT_STEP, k - c) / 4;
        for (int64_t j = 0; j < dwords; ++j)
          for (int64_t r = 0; r < R; ++r)
            for (int64_t b = 0; b < 4; ++b) f(step + 64 * j + 4 * r + b, (g * R + r) * k + c + 4 * j + b);
      }
  });
  for (int64_t i = whole * k; i < n * k; ++i) f(i, i);
}

// uint8 tiles (splice.native.int8_tile_pack) -> int8 rows; int8 rows are returned as they are. For the ops that read
// rows (prefill, the levels without AVX512-VNNI): a copy each call.
at::Tensor int8_rows(const at::Tensor& w) {
  check_int8_weight(w, "int8_rows");
  if (w.scalar_type() == at::kChar) return w;
  at::Tensor rows = at::empty(w.sizes(), w.options().dtype(at::kChar));
  const uint8_t* src = w.data_ptr<uint8_t>();
  auto* dst = reinterpret_cast<uint8_t*>(rows.data_ptr<int8_t>());
  for_tile_bytes(w.size(0), w.size(1), [&](int64_t t, int64_t r) { dst[r] = src[t] ^ 0x80; });
  return rows;
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w_in, const at::Tensor& scales) {
  check_isa("int8_gemv");
  check_int8_weight(w_in, "int8_gemv");
  check_rows(x, w_in.size(1), "int8_gemv");
  check_int8_scales(scales, w_in.size(0), "int8_gemv");
  const at::Tensor w = int8_rows(w_in);
  return isa() >= ISA_AVX512 ? avx512::int8_gemv(x, w, scales) : avx2::int8_gemv(x, w, scales);
}

// Whether the integer dot products run on AVX512-VNNI (vpdpbusd): the avx512 or amx level, on a CPU with it; else
// they run on the AVX2 kernels (vpmaddubsw), which every level's CPU executes.
bool vnni_ready() { return isa() >= ISA_AVX512 && __builtin_cpu_supports("avx512vnni"); }

// Whether an int8 layer's weight is best kept in tiles here: where the avx512 level's integer dot products serve all
// its decode rows (AVX512-VNNI, no AMX tiles, whose int8 GEMV reads rows).
bool int8_tiles_ready() { return vnni_ready() && !amx_ready(); }

bool cpu_has_avx_vnni() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax >> 4 & 1);
}

std::atomic<bool> avx_vnni_allowed{true};

// Whether the AVX2 kernels' integer dot products use AVX-VNNI's 256-bit vpdpbusd: on a CPU with it, unless
// set_avx_vnni(false) (to time or test the vpmaddubsw path, which AVX2 CPUs without AVX-VNNI run).
bool avx_vnni_ready() {
  static const bool here = cpu_has_avx_vnni();
  return here && avx_vnni_allowed.load(std::memory_order_relaxed);
}

void set_avx_vnni(bool on) {
  TORCH_CHECK(!on || cpu_has_avx_vnni(), "set_avx_vnni: this CPU lacks AVX-VNNI; allowed: false");
  avx_vnni_allowed.store(on, std::memory_order_relaxed);
}

// Whether int8_dot_gemv / int4_dot_gemv multiply in integers at the active level: at every level (AVX512-VNNI, else
// vpmaddubsw).
bool int8_dot_ready() { return isa() >= ISA_AVX2; }
bool int4_dot_ready() { return isa() >= ISA_AVX2; }

// The weight and scales the integer dot products of an int8 weight take (whole blocks of DOT_BLOCK inputs).
void check_int8_dot_weight(const at::Tensor& w, const at::Tensor& scales, const char* name) {
  check_int8_weight(w, name);
  check_int8_scales(scales, w.size(0), name);
  TORCH_CHECK(w.size(1) % DOT_BLOCK == 0, name, ": in_features must be a multiple of ", DOT_BLOCK, ", got ",
              w.size(1));
}

// The arguments of an int8 weight's integer dot products (int8_dot_gemv, int8_dot16_gemv): K whole blocks of 32.
void check_int8_dot(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const char* name) {
  check_isa(name);
  check_int8_dot_weight(w, scales, name);
  check_rows(x, w.size(1), name);
}

// W8A8's decode product in integers: AVX512-VNNI where vnni_ready() (on int8 rows or tiles), else vpmaddubsw.
at::Tensor int8_dot_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  check_int8_dot(x, w, scales, "int8_dot_gemv");
  if (vnni_ready()) return avx512::int8_dot_gemv(x, w, scales);
  const at::Tensor rows = int8_rows(w);
  return avx_vnni_ready() ? avx2::int8_dot_gemv<true>(x, rows, scales) : avx2::int8_dot_gemv<false>(x, rows, scales);
}

// A grouped int8 weight as int8_dot_gemv_grouped takes it: int8 rows or tiles [N, K], scales bf16 [ceil(N / 16),
// groups, 16] (GroupedScales), every group whole blocks of DOT_BLOCK columns.
void check_int8_grouped_weight(const at::Tensor& w, const at::Tensor& scales, const char* name) {
  check_int8_weight(w, name);
  const int64_t tiles = (w.size(0) + SCALE_TILE - 1) / SCALE_TILE;
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == tiles && scales.size(1) >= 1 && scales.size(2) == SCALE_TILE &&
                  scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(),
              name, ": scales must be a contiguous bf16 [", tiles, ", groups, 16] tensor (splice.native."
              "int8_group_scales_pack), got ", scales.scalar_type(), " ", scales.sizes());
  const int64_t k = w.size(1), groups = scales.size(1);
  TORCH_CHECK(k % groups == 0 && (k / groups) % DOT_BLOCK == 0, name, ": in_features ", k, " in ", groups,
              " groups; each group must be a whole multiple of ", DOT_BLOCK, " columns");
}

// A grouped int8 weight's decode product in integers (x rounded to int8 per row and block of 32): w int8 rows or tiles
// [N, K], scales as GroupedScales lays them out; AVX512-VNNI where vnni_ready(), else the AVX2 kernels (AVX-VNNI or
// vpmaddubsw) on rows.
at::Tensor int8_dot_gemv_grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const char* name = "int8_dot_gemv_grouped";
  check_isa(name);
  check_int8_grouped_weight(w, scales, name);
  check_rows(x, w.size(1), name);
  if (vnni_ready()) return avx512::int8_dot_gemv_grouped(x, w, scales);
  const at::Tensor rows = int8_rows(w);
  return avx_vnni_ready() ? avx2::int8_dot_gemv_grouped<true>(x, rows, scales)
                          : avx2::int8_dot_gemv_grouped<false>(x, rows, scales);
}

// int8 weight-only's decode product where the CPU has no VNNI: x rounded to int16 per row and block of 256, vpmaddwd.
at::Tensor int8_dot16_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  check_int8_dot(x, w, scales, "int8_dot16_gemv");
  return avx2::int8_dot16_gemv(x, int8_rows(w), scales);
}

// A grouped int8 weight's decode product on int16 activations (x rounded as int8_dot16_gemv rounds it): grouped int8's
// decode rows at the avx2 level without AVX-VNNI, as int8_dot16_gemv is per-channel int8's.
at::Tensor int8_dot16_gemv_grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const char* name = "int8_dot16_gemv_grouped";
  check_isa(name);
  check_int8_grouped_weight(w, scales, name);
  check_rows(x, w.size(1), name);
  return avx2::int8_dot16_gemv_grouped(x, w, scales);
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& w, int64_t group) {
  check_isa("int4_gemv");
  check_int4_tiles(w, group, "int4_gemv");
  check_rows(x, w.size(1) * group, "int4_gemv");
  return isa() >= ISA_AVX512 ? avx512::int4_gemv(x, w, group) : avx2::int4_gemv(x, w, group);
}

// int4 decode rows with x rounded to int8 per block of 32 and integer dot products (AVX512-VNNI where vnni_ready(),
// else vpmaddubsw) where the group is whole blocks; else (and from AMX_MIN_ROWS rows on AMX) int4_gemv on x as it is.
at::Tensor int4_dot_gemv(const at::Tensor& x, const at::Tensor& w, int64_t group) {
  check_isa("int4_dot_gemv");
  check_int4_tiles(w, group, "int4_dot_gemv");
  check_rows(x, w.size(1) * group, "int4_dot_gemv");
  const bool tiles = x.size(0) >= avx512::INT4_DOT_AMX_MIN_ROWS && group % avx512::AMX_COLUMNS == 0 && amx_ready();
  if (!int4_dot_ready() || group % DOT_BLOCK != 0 || tiles) return int4_gemv(x, w, group);
  if (vnni_ready()) return avx512::int4_dot_gemv(x, w, group);
  return avx_vnni_ready() ? avx2::int4_dot_gemv<true>(x, w, group) : avx2::int4_dot_gemv<false>(x, w, group);
}

void int8_to_bf16_into(const int8_t* src, int64_t numel, at::BFloat16* dst) {
  if (isa() >= ISA_AVX512) avx512::int8_to_bf16_into(src, numel, dst);
  else avx2::int8_to_bf16_into(src, numel, dst);
}

void int4_dequantize_into(const at::Tensor& w, int64_t group, int64_t first, int64_t end, at::BFloat16* out) {
  if (isa() >= ISA_AVX512) avx512::int4_dequantize_into(w, group, first, end, out);
  else avx2::int4_dequantize_into(w, group, first, end, out);
}

at::Tensor int4_dequantize(const at::Tensor& w, int64_t group) {
  check_isa("int4_dequantize");
  check_int4_tiles(w, group, "int4_dequantize");
  auto out = at::empty({w.size(0) * TILE, w.size(1) * group}, w.options().dtype(at::kBFloat16));
  int4_dequantize_into(w, group, 0, w.size(0), out.data_ptr<at::BFloat16>());
  return out;
}

// ---- prefill: one oneDNN GEMM on the de-quantised weight ---------------------------------------------------------
// Many rows of x: the weight is de-quantised to bf16 and multiplied by one oneDNN GEMM. The bf16 copy goes into a
// buffer kept between calls (grown to the largest weight seen): a fresh one each call costs Linux's zeroing of its
// pages, which took longer than the conversion itself. Conversion and GEMM are one op, so the buffer never outlives
// the GEMM that reads it (torch.compile may reorder separate ops).
std::mutex prefill_mutex;
at::Tensor prefill_buffer;  // guarded by prefill_mutex

// A [rows, k] view of a kept buffer, grown when too small; the caller holds prefill_mutex.
at::Tensor kept_matrix(at::Tensor& buffer, at::ScalarType dtype, int64_t rows, int64_t k) {
  if (!buffer.defined() || buffer.numel() < rows * k) {
    buffer = at::Tensor();  // freed before the larger one is made
    buffer = at::empty({rows * k}, at::TensorOptions().dtype(dtype));
  }
  return buffer.narrow(0, 0, rows * k).view({rows, k});
}

at::Tensor prefill_weight(int64_t n, int64_t k) { return kept_matrix(prefill_buffer, at::kBFloat16, n, k); }

// ---- prefill on a CPU without bf16 arithmetic: float32 GEMMs on slabs of the widened weight -------------------------
// Where oneDNN has no bf16 GEMM (AVX2-only CPUs) torch's bf16 matmul is several times slower than its float32 one.
// There the product runs as float32 GEMMs, one per slab of weight rows widened into a small kept buffer: the slab is
// still in cache when the GEMM reads it, and no float32 copy of the whole weight is made. The widened values are the
// bf16 path's exactly (the same de-quantised bf16 weight, or the int8 codes, widened), so only the GEMM's arithmetic
// changes (float32 products, float32 sums in both).
constexpr int64_t SLAB_BYTES = 1 << 21;  // float32 bytes of weight per GEMM
at::Tensor slab_buffer;                  // float32; guarded by prefill_mutex


// x [M, K] @ W.T in float32 for W [n, K] = widen(first, rows, slab) a slab at a time (rows a multiple of `multiple`
// except the last); the caller holds prefill_mutex.
template <typename Widen>
at::Tensor widened_gemms(const at::Tensor& x, int64_t n, int64_t multiple, Widen&& widen) {
  const int64_t k = x.size(1);
  const int64_t rows = std::max<int64_t>(1, SLAB_BYTES / (4 * k * multiple)) * multiple;
  const at::Tensor xf = x.detach().to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), n}, xf.options());
  // The kept slab may have been made inside torch.inference_mode and be written outside it: every write to it (and
  // to out) happens in inference mode, where that is allowed.
  const c10::InferenceMode inference_mode;
  for (int64_t first = 0; first < n; first += rows) {
    const int64_t here = std::min(rows, n - first);
    at::Tensor slab = kept_matrix(slab_buffer, at::kFloat, here, k);
    widen(first, here, slab);
    at::Tensor part = out.narrow(1, first, here);  // row stride n: BLAS writes it in place
    at::mm_out(part, xf, slab.t());
  }
  return out;
}

// widened_gemms for a weight torch can widen itself (bf16, fp16, int8 codes): each slab a copy of its rows.
at::Tensor widened_copies(const at::Tensor& x, const at::Tensor& w) {
  return widened_gemms(x, w.size(0), 1, [&](int64_t first, int64_t rows, at::Tensor& slab) {
    slab.copy_(w.narrow(0, first, rows));
  });
}

int64_t prefill_buffer_bytes() {
  std::lock_guard<std::mutex> lock(prefill_mutex);
  return (prefill_buffer.defined() ? prefill_buffer.nbytes() : 0) + (slab_buffer.defined() ? slab_buffer.nbytes() : 0);
}

void release_prefill_buffer() {
  std::lock_guard<std::mutex> lock(prefill_mutex);
  prefill_buffer = at::Tensor();
  slab_buffer = at::Tensor();
}

void check_float_weight(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu() &&
                  (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              name, ": w must be a contiguous bf16 or fp16 CPU matrix [N, K], got ", w.scalar_type(), " ", w.sizes());
}

// Prompts' x @ w.T for a 16-bit weight as float32 GEMMs on widened slabs (a CPU without 16-bit arithmetic); the
// output in x's dtype.
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& w) {
  check_float_weight(w, "widened_linear");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.is_floating_point() && x.size(1) == w.size(1),
              "widened_linear: x must be a float CPU matrix [M, ", w.size(1), "], got ", x.sizes());
  std::lock_guard<std::mutex> lock(prefill_mutex);
  return widened_copies(x, w).to(x.scalar_type());
}

// widen: float32 GEMMs on widened slabs (a CPU without bf16 arithmetic), else one oneDNN bf16 GEMM.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w_in, const at::Tensor& scales, bool widen) {
  check_isa("int8_linear");
  check_int8_weight(w_in, "int8_linear");
  check_rows(x, w_in.size(1), "int8_linear");
  std::lock_guard<std::mutex> lock(prefill_mutex);
  if (widen) return (widened_copies(x, int8_rows(w_in)) * scales).to(x.scalar_type());
  const int64_t n = w_in.size(0), k = w_in.size(1);
  const at::Tensor weight = prefill_weight(n, k);
  if (w_in.scalar_type() == at::kByte && isa() >= ISA_AVX512) {  // tiles straight into the kept buffer
    avx512::int8_tiles_to_bf16_into(w_in.data_ptr<uint8_t>(), n, k, weight.data_ptr<at::BFloat16>());
  } else {
    const at::Tensor w = int8_rows(w_in);
    int8_to_bf16_into(w.data_ptr<int8_t>(), w.numel(), weight.data_ptr<at::BFloat16>());
  }
  return at::linear(x, weight) * scales;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, int64_t group, bool widen) {
  check_isa("int4_linear");
  check_int4_tiles(w, group, "int4_linear");
  const int64_t n = w.size(0) * TILE, k = w.size(1) * group;
  check_rows(x, k, "int4_linear");
  std::lock_guard<std::mutex> lock(prefill_mutex);
  if (widen) {
    return widened_gemms(x, n, TILE, [&](int64_t first, int64_t rows, at::Tensor& slab) {
      const at::Tensor weight = prefill_weight(rows, k);
      int4_dequantize_into(w, group, first / TILE, (first + rows) / TILE, weight.data_ptr<at::BFloat16>());
      slab.copy_(weight);
    }).to(x.scalar_type());
  }
  const at::Tensor weight = prefill_weight(n, k);
  int4_dequantize_into(w, group, 0, w.size(0), weight.data_ptr<at::BFloat16>());
  return at::linear(x, weight);
}

// GPTQ's sweep over columns [first, end) of one block of weight columns (splice/quant/gptq.py, _torch_sweep):
// for each column i, code = clamp(round((w[:, i] - zero) / scale + 8), 0, 15), err = (w[:, i] - ((code - 8) * scale
// + zero)) / hinv[i, i], and w[:, j] -= err * hinv[i, j] for the block's later columns j. Rows are independent, so
// threads take rows. Compiled for baseline x86-64: no fused multiply-adds, each step rounded as torch's separate ops
// round it, so the codes are the torch loop's exactly.
//   w, codes, errors float32 [N, B]; hinv float32 [B, B]; scales, zeros float32 [N, end - first] (each column's) or
//   [N, 1] (one group's, for every column of the range)
void gptq_columns(const at::Tensor& w, const at::Tensor& hinv, int64_t first, int64_t end, const at::Tensor& scales,
                  const at::Tensor& zeros, const at::Tensor& codes, const at::Tensor& errors) {
  TORCH_CHECK(w.dim() == 2, "gptq_columns: w must be a float32 matrix [N, B], got ", w.sizes());
  const int64_t n = w.size(0), b = w.size(1);
  const auto float_matrix = [](const at::Tensor& t, int64_t rows, int64_t cols) {
    return t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.is_contiguous() && t.device().is_cpu() &&
           t.scalar_type() == at::kFloat;
  };
  TORCH_CHECK(0 <= first && first <= end && end <= b, "gptq_columns: columns [", first, ", ", end,
              ") must lie in the block's ", b);
  const int64_t params = scales.dim() == 2 ? scales.size(1) : -1;
  TORCH_CHECK(float_matrix(w, n, b) && float_matrix(hinv, b, b) && float_matrix(codes, n, b) &&
                  float_matrix(errors, n, b) && (params == 1 || params == end - first) &&
                  float_matrix(scales, n, params) && float_matrix(zeros, n, params),
              "gptq_columns: contiguous float32 CPU matrices w, codes, errors [N, B], hinv [B, B], scales and zeros "
              "[N, end - first] or [N, 1]; got w ", w.sizes(), ", hinv ", hinv.sizes(), ", scales ", scales.sizes(),
              ", zeros ", zeros.sizes(), ", codes ", codes.sizes(), ", errors ", errors.sizes());
  const float* h = hinv.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  float* cp = codes.data_ptr<float>();
  float* ep = errors.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t stop) {
    for (int64_t r = begin; r < stop; ++r) {
      float* row = wp + r * b;
      for (int64_t i = first; i < end; ++i) {
        const int64_t p = r * params + (params == 1 ? 0 : i - first);
        const float scale = sp[p], zero = zp[p], column = row[i];
        const float code = std::min(std::max(std::nearbyint((column - zero) / scale + 8.0f), 0.0f), 15.0f);
        const float err = (column - ((code - 8.0f) * scale + zero)) / h[i * b + i];
        cp[r * b + i] = code;
        ep[r * b + i] = err;
        const float* h_row = h + i * b;
        for (int64_t j = i + 1; j < b; ++j) row[j] -= err * h_row[j];
      }
    }
  });
}

// Reads every byte of t once in streams sequential streams, with or without prefetch (time it for the machine's read
// bandwidth); a checksum.
int64_t stream_read(const at::Tensor& t, int64_t streams, bool prefetch_ahead) {
  check_isa("stream_read");
  TORCH_CHECK(streams == 1 || streams == 2 || streams == avx2::STREAMS, "stream_read: ", streams,
              " streams; allowed: 1, 2 or ", avx2::STREAMS);
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu() && t.nbytes() % (64 * avx2::STREAMS) == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 32 == 0,
              "stream_read: a contiguous, 32-byte aligned CPU tensor of whole 256-byte blocks, got ", t.sizes());
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  const uint64_t sum = streams == 1   ? avx2::stream_read<1>(p, t.nbytes(), prefetch_ahead)
                       : streams == 2 ? avx2::stream_read<2>(p, t.nbytes(), prefetch_ahead)
                                      : avx2::stream_read<avx2::STREAMS>(p, t.nbytes(), prefetch_ahead);
  return static_cast<int64_t>(sum);
}


// ---- one decoder layer of a decode step ----------------------------------------------------------------------------
// A pre-norm decoder layer (Llama's and its relatives') for one new token per row, as one function (layer_step, run
// by decode_layers below): its norm, the QKV GEMV, a per-head RMSNorm of q and k where the layer has one (qk-norm),
// rotary on q and k, the keys and values written into the layer's cache at their slots, decode_attention, the o GEMV
// and residual add, the MLP's norm, the gate+up GEMV, act(gate) * up, the down GEMV and residual add. Its layout
// (LayerLayout) varies that: RMSNorm or LayerNorm (with or without biases); a gated MLP or a plain one, act(up), with
// SiLU, GELU, the tanh GELU or ReLU; and a parallel block (GPT-NeoX, Phi, Falcon, GPT-J), whose MLP reads the layer's
// input x through its own norm, or through the attention's where it has none, and adds into the same residual. The
// fused block's ops make a dozen calls for that, each with its dispatch, allocations and threads to wake: in a small
// model those cost more than reading the weights. The arithmetic is theirs: the same GEMVs and attention, and each
// elementwise result rounded to bf16 where the block's eager ops round it.
//
// Each linear is three entries of `tensors` (weight, scales, bias: None where absent) plus its GEMV kind and int4
// group; a bias is added in bf16 after the GEMV, as the linear layers add it.
enum LayerGemv : int64_t {
  GEMV_BF16, GEMV_INT8, GEMV_INT8_DOT, GEMV_INT8_DOT16, GEMV_INT4, GEMV_INT4_DOT, GEMV_INT8_GROUPED,
  GEMV_INT8_GROUPED16, GEMV_KINDS
};
inline bool int4_kind(int64_t kind) { return kind == GEMV_INT4 || kind == GEMV_INT4_DOT; }
inline bool grouped_kind(int64_t kind) { return kind == GEMV_INT8_GROUPED || kind == GEMV_INT8_GROUPED16; }
constexpr int64_t LAYER_LINEARS = 4, TENSORS_PER_LINEAR = 3;  // qkv, o, gate_up, down; weight, scales, bias
// A layer's norm tensors: the attention's, the MLP's (None: a parallel block's MLP reads the attention's), the
// qk-norm's (or None) weights, the attention's and the MLP's LayerNorm biases (or None), and the weights of the norms
// on the attention's and the MLP's outputs before their residual adds (or None: Gemma 2 and 3's, OLMo 2's); and their
// eps (the attention's, the MLP's, the qk-norm's, the two output norms').
constexpr int64_t LAYER_NORMS = 7, LAYER_EPS = 5;
// A layer's layout: four integers a layer in decode_layers' `layouts` (splice.layers.native_layer.layer_layout).
// NORM_RMS_FLOAT: an RMSNorm whose weight is float32, the product rounded once (Gemma's folded 1 + w)
enum NormKind : int64_t { NORM_RMS, NORM_LAYER, NORM_RMS_FLOAT, NORM_KINDS };
enum MlpActivation : int64_t { ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_RELU, ACTIVATIONS };
constexpr int64_t LAYER_LAYOUT = 4;  // norm kind, activation, gated (1) or plain (0), parallel (1) or not (0)

struct LayerLinear {
  int64_t kind = GEMV_BF16, group = 0;  // int4: columns per group; grouped int8: inputs per group (0: the weight's)
  at::Tensor w, scales, bias;
};

// The weight columns a grouped int8 linear gives each group of `group` inputs: whole blocks of DOT_BLOCK, the group
// zero-padded to them (as splice.quant.layers.padded_group); `group` itself where it is whole blocks or 0.
inline int64_t kept_group(int64_t group) { return (group + DOT_BLOCK - 1) / DOT_BLOCK * DOT_BLOCK; }

// x [m, groups * group] laid out as a grouped int8 weight whose groups are zero-padded to kept columns reads it, in
// `buffer` (each team thread spreads its own copy: x is one row or a few).
at::Tensor spread_groups(const at::Tensor& x, int64_t group, int64_t kept, std::vector<at::BFloat16>& buffer) {
  const int64_t m = x.size(0), groups = x.size(1) / group;
  buffer.assign(m * groups * kept, at::BFloat16(0.f));
  const at::BFloat16* src = x.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t g = 0; g < groups; ++g)
      std::copy_n(src + i * x.stride(0) + g * group, group, buffer.data() + (i * groups + g) * kept);
  return at::from_blob(buffer.data(), {m, groups * kept}, x.options());
}

// The GEMV of one linear for rows x into y [rows, outputs], and its bias (the linear checked beforehand:
// check_layer_linears; the bias bf16 and contiguous). In a team every thread calls it, and y is complete when it
// returns.
void layer_gemv_into(const LayerLinear& l, const at::Tensor& x, const at::Tensor& y) {
  {
    const OutputInto into(y);
    switch (l.kind) {
      case GEMV_BF16: bf16_gemv(x, l.w); break;
      case GEMV_INT8: int8_gemv(x, l.w, l.scales); break;
      case GEMV_INT8_DOT: int8_dot_gemv(x, l.w, l.scales); break;
      case GEMV_INT8_DOT16: int8_dot16_gemv(x, l.w, l.scales); break;
      case GEMV_INT4: int4_gemv(x, l.w, l.group); break;
      case GEMV_INT4_DOT: int4_dot_gemv(x, l.w, l.group); break;
      default: {
        const int64_t kept = kept_group(l.group);
        thread_local std::vector<at::BFloat16> spread;
        const at::Tensor xs = kept == l.group ? x : spread_groups(x, l.group, kept, spread);
        if (l.kind == GEMV_INT8_GROUPED16) int8_dot16_gemv_grouped(xs, l.w, l.scales);
        else int8_dot_gemv_grouped(xs, l.w, l.scales);
      }
    }
  }
  team_barrier();  // every thread's rows (and the leader's tail) written
  if (!l.bias.defined()) return;
  if (leads_team()) {
    const int64_t n = y.size(1);
    const at::BFloat16* bias = l.bias.data_ptr<at::BFloat16>();
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    for (int64_t m = 0; m < y.size(0); ++m) avx2::add_row(yp + m * n, bias, n, yp + m * n);
  }
  team_barrier();
}

// A linear's weight, scales and bias from tensors[first ..] (its kind set), named `who` in errors.
void take_linear_tensors(LayerLinear& l, const c10::List<std::optional<at::Tensor>>& tensors, int64_t first,
                         const std::string& who) {
  TORCH_CHECK(0 <= l.kind && l.kind < GEMV_KINDS, who, ": GEMV kind ", l.kind, "; allowed: 0 .. ", GEMV_KINDS - 1);
  const std::optional<at::Tensor> w = tensors.get(first);
  const std::optional<at::Tensor> scales = tensors.get(first + 1);
  const std::optional<at::Tensor> bias = tensors.get(first + 2);
  const bool own_scales = l.kind == GEMV_BF16 || int4_kind(l.kind);  // int4 tiles hold their scales
  TORCH_CHECK(w.has_value() && (own_scales || scales.has_value()), who, " needs its weight",
              own_scales ? "" : " and scales");
  l.w = *w;
  if (scales) l.scales = *scales;
  if (bias) l.bias = *bias;
}

// Layer `layer`'s `count` linears from decode_layers' lists (the list sizes checked beforehand): its four, or
// the attention's two (qkv, o: decode_attention_half).
std::vector<LayerLinear> layer_linears(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef kinds,
                                       at::IntArrayRef groups, int64_t layer, const std::string& who,
                                       int64_t count = LAYER_LINEARS) {
  std::vector<LayerLinear> linears(count);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t at = layer * count + i, first = at * TENSORS_PER_LINEAR;
    LayerLinear& l = linears[i];
    l.kind = kinds[at];
    l.group = groups[at];
    take_linear_tensors(l, tensors, first, who + ": linear " + std::to_string(i));
  }
  return linears;
}

// A norm's weight: contiguous bf16 [hidden], or float32 where `float_weight` (`what` names it in the error).
void check_norm_weight(const at::Tensor& norm, int64_t hidden, const std::string& what, bool float_weight = false) {
  const at::ScalarType dtype = float_weight ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(norm.dim() == 1 && norm.size(0) == hidden && norm.scalar_type() == dtype && norm.is_contiguous(),
              what, " must be contiguous ", float_weight ? "float32" : "bf16", " [", hidden, "], got ",
              norm.scalar_type(), " ", norm.sizes());
}

// A step's inputs to one layer (its norms, heads and linears were checked with its stack: layer_stack).
void check_layer_inputs(const at::Tensor& x, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots,
                        int64_t kv_len, const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                        int64_t n_kv_heads, const std::string& who) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.size(0) >= 1 && x.scalar_type() == at::kBFloat16 &&
                  x.is_contiguous() && x.device().is_cpu(),
              who, ": x must be a contiguous bf16 CPU tensor [B, 1, hidden], got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t batch = x.size(0);
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.size(0) == batch &&
                  keys.size(1) == n_kv_heads && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16 && keys.stride(3) == 1 && values.stride(3) == 1 &&
                  head_dim_fits(keys.size(3)),
              who, ": keys and values must be bf16 [", batch, ", ", n_kv_heads, ", L, head_dim], head_dim a multiple "
              "of 16 up to ", MAX_HEAD_DIM, ", contiguous in head_dim; got ", keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(1 <= kv_len && kv_len <= keys.size(2), who, ": kv_len ", kv_len, " outside 1 .. ", keys.size(2));
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  ((slots.dim() == 1 && slots.numel() == 1) ||
                   (slots.dim() == 2 && slots.size(0) == batch && slots.size(1) == 1)),
              who, ": slots must be int64 [1] or [", batch, ", 1], got ", slots.scalar_type(), " ",
              slots.sizes());
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(0 <= sp[i] && sp[i] < keys.size(2), who, ": slot ", sp[i], " outside the cache's 0 .. ",
                keys.size(2) - 1);
  TORCH_CHECK(cos.has_value() == sin.has_value(), who, ": cos and sin come together");
  if (cos) {
    const int64_t rotary = cos->size(-1);
    TORCH_CHECK(cos->sizes() == sin->sizes() && cos->numel() == batch * rotary && rotary % 2 == 0 &&
                    rotary <= keys.size(3) && cos->scalar_type() == at::kBFloat16 &&
                    sin->scalar_type() == at::kBFloat16 && cos->is_contiguous() && sin->is_contiguous(),
                who, ": cos and sin must be contiguous bf16 with ", batch,
                " rows of an even rotary size up to head_dim, got ", cos->sizes(), " and ", sin->sizes());
  }
}

// A linear's [outputs, inputs] as its GEMV reads them (int4 tiles: 16 rows a tile, 8 columns a word; grouped int8:
// each group's padding left out).
std::pair<int64_t, int64_t> linear_shape(const LayerLinear& l) {
  if (int4_kind(l.kind)) return {l.w.size(0) * TILE, l.w.size(1) * l.group};
  if (grouped_kind(l.kind) && l.group > 0) return {l.w.size(0), l.w.size(1) / kept_group(l.group) * l.group};
  return {l.w.size(0), l.w.size(1)};
}

// One linear's tensors as its GEMV's own checks want them, and its bias's size.
void check_layer_linear(const LayerLinear& l, const std::string& name) {
  if (l.kind == GEMV_BF16) {
    check_bf16_weight(l.w, name.c_str());
  } else if (int4_kind(l.kind)) {
    check_int4_tiles(l.w, l.group, name.c_str());
  } else if (grouped_kind(l.kind)) {
    check_int8_grouped_weight(l.w, l.scales, name.c_str());
    TORCH_CHECK(l.group >= 0 && (l.group == 0 || l.w.size(1) == l.scales.size(1) * kept_group(l.group)), name,
                ": a grouped int8 weight of ", l.w.size(1), " columns in ", l.scales.size(1), " groups does not hold ",
                "groups of ", l.group, " inputs (each zero-padded to ", kept_group(l.group), " columns)");
  } else if (l.kind == GEMV_INT8) {
    check_int8_weight(l.w, name.c_str());
    check_int8_scales(l.scales, l.w.size(0), name.c_str());
  } else {
    check_int8_dot_weight(l.w, l.scales, name.c_str());
  }
  const int64_t n = linear_shape(l).first;
  TORCH_CHECK(!l.bias.defined() || (l.bias.numel() == n && l.bias.is_floating_point()), name,
              ": the bias must be a float tensor of ", n, " values, got ",
              l.bias.defined() ? l.bias.sizes() : at::IntArrayRef());
}

// Every linear, and its shape against the layer's, before anything is written: qkv [width, hidden], o [hidden,
// heads * dim], gate_up [2 ffn, hidden], down [hidden, ffn] (ffn from down).
void check_layer_linears(const std::vector<LayerLinear>& linears, int64_t hidden, int64_t width, int64_t attended,
                         const std::string& who, bool gated = true) {
  const char* names[LAYER_LINEARS] = {"qkv", "o", "gate_up", "down"};
  const int64_t count = static_cast<int64_t>(linears.size());  // all four, or the attention's two (qkv, o)
  for (int64_t i = 0; i < count; ++i)
    check_layer_linear(linears[i], who + ": the " + names[i] + " linear");
  const int64_t ffn = count == LAYER_LINEARS ? linear_shape(linears[3]).second : 0;
  const std::pair<int64_t, int64_t> wanted[LAYER_LINEARS] = {
      {width, hidden}, {hidden, attended}, {(gated ? 2 : 1) * ffn, hidden}, {hidden, ffn}};
  for (int64_t i = 0; i < count; ++i) {
    const auto [n, k] = linear_shape(linears[i]);
    TORCH_CHECK(n == wanted[i].first && k == wanted[i].second, who, ": the ", names[i], " linear is [", n,
                ", ", k, "] (outputs, inputs); the layer needs [", wanted[i].first, ", ", wanted[i].second, "]");
  }
}

// RMSNorm of each of the rows of x [rows, hidden] into out.
void rms_norm_rows(const at::BFloat16* x, int64_t rows, int64_t hidden, const at::Tensor& weight, double eps,
                   at::BFloat16* out) {
  for (int64_t m = 0; m < rows; ++m)
    avx2::rms_norm_row(x + m * hidden, weight.data_ptr<at::BFloat16>(), hidden, static_cast<float>(eps),
                       out + m * hidden);
}

// rms_norm(x, weight, eps): RMSNorm of bf16 rows x [..., n] with a bf16 weight [n], rounded as splice.layers.norm
// rounds it in bf16 (as decode_layers' norms): for a decode step's few rows, one call where the eager form makes four.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_isa("rms_norm");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
                  weight.device().is_cpu() && x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 &&
                  x.dim() >= 1 && x.size(-1) == weight.numel(),
              "rms_norm: x must be contiguous bf16 [..., n] and weight bf16 [n] on the CPU, got ", x.sizes(), " ",
              x.scalar_type(), " and ", weight.sizes(), " ", weight.scalar_type());
  at::Tensor out = at::empty_like(x);
  const int64_t n = weight.numel();
  if (n > 0) rms_norm_rows(x.data_ptr<at::BFloat16>(), x.numel() / n, n, weight, eps, out.data_ptr<at::BFloat16>());
  return out;
}

// The norm of a layer (NormKind `kind`: RMSNorm, with a float32 weight, or LayerNorm with its bias where defined) of
// rows x [rows, hidden] into out.
void norm_rows(int64_t kind, const at::BFloat16* x, int64_t rows, int64_t hidden, const at::Tensor& weight,
               const at::Tensor& bias, double eps, at::BFloat16* out) {
  if (kind == NORM_RMS) return rms_norm_rows(x, rows, hidden, weight, eps, out);
  const at::BFloat16* b = bias.defined() ? bias.data_ptr<at::BFloat16>() : nullptr;
  for (int64_t m = 0; m < rows; ++m) {
    const at::BFloat16* row = x + m * hidden;
    if (kind == NORM_LAYER)
      avx2::layer_norm_row(row, weight.data_ptr<at::BFloat16>(), b, hidden, static_cast<float>(eps), out + m * hidden);
    else
      avx2::rms_norm_row_float(row, weight.data_ptr<float>(), hidden, static_cast<float>(eps), out + m * hidden);
  }
}

// out[m] = a[m] + b[m] for rows of `width`, in bf16.
void add_rows(const at::BFloat16* a, const at::BFloat16* b, int64_t rows, int64_t width, at::BFloat16* out) {
  for (int64_t m = 0; m < rows; ++m) avx2::add_row(a + m * width, b + m * width, width, out + m * width);
}

// x [rows, width] times `scale` in place, each product in float32 rounded to bf16: what torch computes for a bf16
// tensor times a Python float (a branch's output times Granite's residual multiplier, before its residual add).
void scale_rows(at::BFloat16* x, int64_t rows, int64_t width, double scale) {
  const float s = static_cast<float>(scale);
  for (int64_t i = 0; i < rows * width; ++i) x[i] = at::BFloat16(static_cast<float>(x[i]) * s);
}

// Rotary on each row's q and k heads of qkv [rows, (heads + 2 kv_heads) * dim], then its k and v heads written into
// keys and values [rows, kv_heads, L, dim] at the row's slot.
void rotate_and_store(at::Tensor& qkv, const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                      const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots, int64_t n_heads,
                      int64_t n_kv_heads, const at::Tensor& qk_norm, double qk_eps) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), dim = keys.size(3);
  at::BFloat16* qp = qkv.data_ptr<at::BFloat16>();
  if (qk_norm.defined()) {  // each q and k head RMS-normed with its row of qk_norm [heads + kv_heads, dim]
    const bool float_weight = qk_norm.scalar_type() == at::kFloat;  // scaled in float32, rounded once (Gemma 3)
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t head = 0; head < n_heads + n_kv_heads; ++head) {
        at::BFloat16* h = qp + m * width + head * dim;
        if (float_weight)
          avx2::rms_norm_row_float(h, qk_norm.data_ptr<float>() + head * dim, dim, static_cast<float>(qk_eps), h);
        else
          avx2::rms_norm_row(h, qk_norm.data_ptr<at::BFloat16>() + head * dim, dim, static_cast<float>(qk_eps), h);
      }
  }
  if (cos) {
    const int64_t rotary = cos->size(-1);
    const at::BFloat16* cp = cos->data_ptr<at::BFloat16>();
    const at::BFloat16* snp = sin->data_ptr<at::BFloat16>();
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t head = 0; head < n_heads + n_kv_heads; ++head)
        avx2::rotate_head(qp + m * width + head * dim, cp + m * rotary, snp + m * rotary, rotary);
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::BFloat16* kp = keys.data_ptr<at::BFloat16>();
  at::BFloat16* vp = values.data_ptr<at::BFloat16>();
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t slot = sp[slots.dim() == 2 ? m : 0];
    for (int64_t h = 0; h < n_kv_heads; ++h) {
      const at::BFloat16* k = qp + m * width + (n_heads + h) * dim;
      std::copy(k, k + dim, kp + m * keys.stride(0) + h * keys.stride(1) + slot * keys.stride(2));
      std::copy(k + n_kv_heads * dim, k + (n_kv_heads + 1) * dim,
                vp + m * values.stride(0) + h * values.stride(1) + slot * values.stride(2));
    }
  }
}

// One layer of a decode_layers call, unpacked from its lists: what stays the same from step to step (LayerStack).
struct LayerCall {
  at::Tensor attn_norm, mlp_norm, qk_norm;  // qk_norm: undefined, or per-head RMSNorm weights of q and k
  at::Tensor attn_norm_bias, mlp_norm_bias;  // LayerNorm's biases, or undefined
  at::Tensor attn_out_norm, mlp_out_norm;  // norms of the branch outputs before their residual adds, or undefined
  // mlp_norm undefined: a parallel block whose MLP reads the attention's norm of x
  int64_t norm = NORM_RMS, activation = ACT_SILU;
  bool gated = true, parallel = false;
  double attn_eps = 0, mlp_eps = 0, qk_eps = 0, attn_out_eps = 0, mlp_out_eps = 0, scale = 0;
  double residual_scale = 1;  // each branch's output times this before its residual add (scale_rows; 1: none)
  int64_t n_heads = 0, n_kv_heads = 0;
  std::vector<LayerLinear> linears;
};

// A layer's inputs that change from step to step: its cache layer's keys and values [B, kv_heads, L, head_dim], its
// mask and rotary rows.
struct LayerInputs {
  at::Tensor keys, values;
  std::optional<at::Tensor> mask, cos, sin;
};

// Checks that lists of `n` layers' entries hold them: got[i] entries of names[i], per_layer[i] a layer.
template <size_t LISTS>
void check_list_sizes(int64_t n, const int64_t (&got)[LISTS], const int64_t (&per_layer)[LISTS],
                      const char* const (&names)[LISTS], const char* op) {
  TORCH_CHECK(n >= 1, op, ": no layers");
  for (size_t i = 0; i < LISTS; ++i)
    TORCH_CHECK(got[i] == per_layer[i] * n, op, ": ", n, " layers take ", per_layer[i] * n, " ", names[i], " (",
                per_layer[i], " a layer), got ", got[i]);
}

// A layer's mask: bool [B or 1, 1, 1, kv_len], or none.
void check_layer_mask(const std::optional<at::Tensor>& mask, int64_t batch, int64_t kv_len, const std::string& who) {
  if (!mask) return;
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(1) == 1 && m.size(2) == 1 &&
                  m.size(3) == kv_len && (m.size(0) == 1 || m.size(0) == batch),
              who, ": the mask must be bool [", batch, " or 1, 1, 1, ", kv_len, "], got ", m.scalar_type(), " ",
              m.sizes());
}

// The buffers a layer's step writes between its kernels, allocated once for a decode_layers call and used by each of
// its layers in turn (made again only where a layer's shapes differ from the one before).
struct LayerBuffers {
  at::Tensor normed, qkv, attended, o, gate_up, act, down;
  std::vector<float> partial;  // attention's partial sums
  int64_t parts = 0;

  bool fits(const LayerCall& l, int64_t ffn, int64_t dim) const {
    return qkv.size(1) == (l.n_heads + 2 * l.n_kv_heads) * dim && attended.size(1) == l.n_heads * dim &&
           act.size(1) == ffn && gate_up.size(1) == (l.gated ? 2 : 1) * ffn;
  }
};

LayerBuffers layer_buffers(const at::Tensor& x, const LayerCall& l, int64_t ffn, int64_t dim, int64_t kv_len) {
  const int64_t batch = x.size(0), hidden = x.size(2);
  const at::TensorOptions options = x.options();
  LayerBuffers b;
  b.normed = at::empty({batch, hidden}, options);
  b.qkv = at::empty({batch, (l.n_heads + 2 * l.n_kv_heads) * dim}, options);
  b.attended = at::empty({batch, l.n_heads * dim}, options);
  b.o = at::empty({batch, hidden}, options);
  b.gate_up = at::empty({batch, (l.gated ? 2 : 1) * ffn}, options);  // a plain MLP's up: ffn
  b.act = at::empty({batch, ffn}, options);
  b.down = at::empty({batch, hidden}, options);
  b.parts = attention_parts(batch, l.n_kv_heads, kv_len, at::get_num_threads());
  b.partial.resize(attention_partial_floats(batch, l.n_heads, dim, b.parts));
  return b;
}

// f(row, first column, columns) for the 256-column chunks of `rows` rows of `ffn` MLP features; in a team each thread
// takes a part of the chunks (so every element takes the path it takes in one pass).
template <typename F>
void for_feature_chunks(int64_t rows, int64_t ffn, const F& f) {
  constexpr int64_t CHUNK = 256;
  const int64_t chunks = (ffn + CHUNK - 1) / CHUNK, units = rows * chunks;
  parallel_units(0, units, units, [&](int64_t begin, int64_t end) {  // one grain: on its own, on this thread
    for (int64_t u = begin; u < end; ++u) {
      const int64_t c = u % chunks * CHUNK;
      f(u / chunks, c, std::min(CHUNK, ffn - c));
    }
  });
}

// SiLU(gate) * up of each row of gate_up [rows, 2 ffn] into act [rows, ffn].
void silu_mul_rows(const at::Tensor& gate_up, int64_t ffn, const at::Tensor& act) {
  const at::BFloat16* gp = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* ap = act.data_ptr<at::BFloat16>();
  for_feature_chunks(gate_up.size(0), ffn, [&](int64_t m, int64_t c, int64_t n) {
    const at::BFloat16* gate = gp + m * 2 * ffn + c;
    avx2::silu_mul_row(gate, gate + ffn, n, ap + m * ffn + c);
  });
}

// act(gate) * up of each row of gate_up [rows, 2 ffn] (gated), or act(up) of up [rows, ffn] (plain), into act [rows,
// ffn], the layer's activation; SiLU gated as silu_mul_rows, the same bits.
void mlp_activation_rows(const LayerCall& l, const at::Tensor& gate_up, int64_t ffn, const at::Tensor& act) {
  if (l.gated && l.activation == ACT_SILU) return silu_mul_rows(gate_up, ffn, act);
  const int64_t width = gate_up.size(1);
  const at::BFloat16* gp = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* ap = act.data_ptr<at::BFloat16>();
  for_feature_chunks(gate_up.size(0), ffn, [&](int64_t m, int64_t c, int64_t n) {
    const at::BFloat16* h = gp + m * width + c;
    avx2::activation_row(h, l.gated ? h + ffn : nullptr, n, l.activation, ap + m * ffn + c);
  });
}

// The attention half of a layer's step for rows x [B, 1, hidden] (checked: decode_layers) into out (the same shape;
// not x: x plus the attention's o), and its MLP's norm of out (of x in a parallel block) into b.normed, with its
// inputs `in` and buffers b:
// its keys and values written at slots. In a team every thread calls it; the leader runs the small ops between the
// kernels, and out and b.normed are complete (on every thread) when it returns.
void attention_step(const at::Tensor& x, const LayerCall& l, const LayerInputs& in, const at::Tensor& slots,
                    int64_t kv_len, LayerBuffers& b, const at::Tensor& out) {
  const std::vector<LayerLinear>& linears = l.linears;
  const int64_t batch = x.size(0), hidden = x.size(2), dim = in.keys.size(3);
  at::BFloat16* normed = b.normed.data_ptr<at::BFloat16>();
  at::BFloat16* outp = out.data_ptr<at::BFloat16>();
  if (leads_team())
    norm_rows(l.norm, x.data_ptr<at::BFloat16>(), batch, hidden, l.attn_norm, l.attn_norm_bias, l.attn_eps, normed);
  team_barrier();
  layer_gemv_into(linears[0], b.normed, b.qkv);
  if (leads_team())
    rotate_and_store(b.qkv, in.cos, in.sin, in.keys, in.values, slots, l.n_heads, l.n_kv_heads, l.qk_norm, l.qk_eps);
  team_barrier();
  // the queries are the first n_heads heads of each qkv row
  const AttentionInputs<at::BFloat16> attention = attention_inputs<at::BFloat16>(
      b.qkv.data_ptr<at::BFloat16>(), b.qkv.size(1), dim, l.n_heads, in.keys, in.values, kv_len, in.mask, l.scale);
  attend_into(attention, b.parts, b.partial.data(), b.attended.data_ptr<at::BFloat16>());
  team_barrier();
  layer_gemv_into(linears[1], b.attended, b.o);
  if (leads_team()) {
    at::BFloat16* o = b.o.data_ptr<at::BFloat16>();
    if (l.attn_out_norm.defined()) norm_rows(l.norm, o, batch, hidden, l.attn_out_norm, {}, l.attn_out_eps, o);
    if (l.residual_scale != 1) scale_rows(o, batch, hidden, l.residual_scale);
    add_rows(x.data_ptr<at::BFloat16>(), o, batch, hidden, outp);
    // a parallel block's MLP reads x through its own norm, or through the attention's (still in normed)
    if (!l.parallel) norm_rows(l.norm, outp, batch, hidden, l.mlp_norm, l.mlp_norm_bias, l.mlp_eps, normed);
    else if (l.mlp_norm.defined())
      norm_rows(l.norm, x.data_ptr<at::BFloat16>(), batch, hidden, l.mlp_norm, l.mlp_norm_bias, l.mlp_eps, normed);
  }
  team_barrier();
}

// The layer's step for rows x [B, 1, hidden] (checked: decode_layers) into out (the same shape; not x), with its
// inputs `in` and buffers b: its keys and values written at slots. In a team every thread calls it; the leader runs
// the small ops between the kernels, and out is complete (on the leader) when it returns.
void layer_step(const at::Tensor& x, const LayerCall& l, const LayerInputs& in, const at::Tensor& slots,
                int64_t kv_len, LayerBuffers& b, const at::Tensor& out) {
  const std::vector<LayerLinear>& linears = l.linears;
  const int64_t batch = x.size(0), hidden = x.size(2), ffn = linear_shape(linears[3]).second;
  at::BFloat16* outp = out.data_ptr<at::BFloat16>();
  attention_step(x, l, in, slots, kv_len, b, out);
  layer_gemv_into(linears[2], b.normed, b.gate_up);
  mlp_activation_rows(l, b.gate_up, ffn, b.act);
  team_barrier();
  layer_gemv_into(linears[3], b.act, b.down);
  if (leads_team()) {
    at::BFloat16* down = b.down.data_ptr<at::BFloat16>();
    if (l.mlp_out_norm.defined()) norm_rows(l.norm, down, batch, hidden, l.mlp_out_norm, {}, l.mlp_out_eps, down);
    if (l.residual_scale != 1) scale_rows(down, batch, hidden, l.residual_scale);
    add_rows(outp, down, batch, hidden, outp);
  }
}

// The model's head after the last layer, where a decode_layers call ends the step: the final norm (NormKind) and the
// lm_head's GEMV (with its bias), whose logits [B, vocab] the call returns. Python's own ops would take longer than
// the norm's arithmetic, and the GEMV would wake the threads again.
struct HeadCall {
  at::Tensor norm, norm_bias;  // norm undefined: no head; norm_bias: a LayerNorm's, or undefined
  int64_t norm_kind = NORM_RMS;
  double eps = 0;
  LayerLinear linear;

  bool given() const { return norm.defined(); }
};

// The head from decode_layers' head arguments: none (an empty list) or the final norm's weight and its LayerNorm bias
// (or None), then the lm_head's weight, scales and bias (None where absent), checked against the hidden size; the
// norm's NormKind and eps, the lm_head's GEMV kind and group.
HeadCall head_call(const c10::List<std::optional<at::Tensor>>& head, double eps, int64_t norm_kind, int64_t kind,
                   int64_t group, int64_t hidden, const char* op) {
  HeadCall h;
  if (head.size() == 0) return h;
  const std::string who = std::string(op) + ": the head";
  constexpr int64_t HEAD_TENSORS = 2 + TENSORS_PER_LINEAR;
  TORCH_CHECK(head.size() == HEAD_TENSORS, who, " takes ", HEAD_TENSORS, " tensors (the final norm's weight and "
              "bias, then the lm_head's weight, scales and bias), got ", head.size());
  TORCH_CHECK(0 <= norm_kind && norm_kind < NORM_KINDS, who, ": norm kind ", norm_kind,
              "; allowed: 0 (RMSNorm), 1 (LayerNorm) or 2 (RMSNorm with a float32 weight)");
  const std::optional<at::Tensor> norm = head.get(0), norm_bias = head.get(1);
  TORCH_CHECK(norm.has_value(), who, ": the final norm's weight is missing");
  TORCH_CHECK(!norm_bias || norm_kind == NORM_LAYER, who, ": only a LayerNorm takes a bias");
  check_norm_weight(*norm, hidden, who + ": the final norm's weight", norm_kind == NORM_RMS_FLOAT);
  if (norm_bias) check_norm_weight(*norm_bias, hidden, who + ": the final norm's bias");
  h.eps = eps;
  h.norm_kind = norm_kind;
  h.linear.kind = kind;
  h.linear.group = group;
  take_linear_tensors(h.linear, head, 2, who + "'s lm_head");
  check_layer_linear(h.linear, who + "'s lm_head");
  TORCH_CHECK(linear_shape(h.linear).second == hidden, who, ": the lm_head takes ", linear_shape(h.linear).second,
              " inputs; the layers' hidden size is ", hidden);
  if (h.linear.bias.defined()) h.linear.bias = h.linear.bias.to(at::kBFloat16).contiguous();
  h.norm = *norm;
  if (norm_bias) h.norm_bias = *norm_bias;
  return h;
}

// The parts of a run of consecutive decoder layers that stay the same from step to step: each layer's cache layer,
// norms, linears, heads and scale (a LayerCall; its step's LayerInputs come with each call), which of a
// step's masks and rotary tables it takes, and the head (HeadCall). decode_layers makes one from its lists every call;
// register_layers keeps one for decode_registered, so a step passes only what changes (a model's hundreds of weights
// cost more to hand over from Python each step than a small model's layers take to run).
struct LayerStack {
  std::vector<LayerCall> calls;
  std::vector<int64_t> layers, mask_of, rope_of;
  HeadCall head;
  int64_t hidden = 0, head_dim = 0;
};

// Layer i's layout (LAYER_LAYOUT entries of `layouts` from 4i; none: RMSNorm, a gated SiLU MLP, not parallel, as
// decode_attention_half's layers are) into l, checked.
void take_layer_layout(LayerCall& l, at::IntArrayRef layouts, int64_t i, const std::string& who) {
  if (layouts.empty()) return;
  const int64_t* layout = layouts.data() + LAYER_LAYOUT * i;
  TORCH_CHECK(0 <= layout[0] && layout[0] < NORM_KINDS && 0 <= layout[1] && layout[1] < ACTIVATIONS &&
                  (layout[2] == 0 || layout[2] == 1) && (layout[3] == 0 || layout[3] == 1),
              who, ": the layout (norm kind, activation, gated, parallel) must be (0 RMSNorm, 1 LayerNorm or 2 RMSNorm "
              "with a float32 weight, 0 SiLU, 1 GELU, 2 tanh GELU or 3 ReLU, 0 or 1, 0 or 1), got (", layout[0], ", ",
              layout[1], ", ", layout[2], ", ", layout[3], ")");
  l.norm = layout[0];
  l.activation = layout[1];
  l.gated = layout[2] == 1;
  l.parallel = layout[3] == 1;
}

// Layer i's norms (the attention's, the MLP's or None in a parallel block, the qk-norm's or None, the LayerNorm
// biases or None, the branch outputs' norms or None), eps, layout, heads and scales (the attention's, the
// residual's: 2i and 2i + 1) from decode_layers' lists (their sizes checked beforehand) into l, checked.
void take_layer_norms(LayerCall& l, const c10::List<std::optional<at::Tensor>>& norms, at::ArrayRef<double> eps,
                      at::IntArrayRef layouts, at::IntArrayRef heads, at::ArrayRef<double> scales, int64_t i,
                      int64_t hidden, int64_t head_dim, const std::string& who) {
  take_layer_layout(l, layouts, i, who);
  const std::optional<at::Tensor> attn_norm = norms.get(LAYER_NORMS * i), mlp_norm = norms.get(LAYER_NORMS * i + 1);
  const std::optional<at::Tensor> qk_norm = norms.get(LAYER_NORMS * i + 2);
  const std::optional<at::Tensor> attn_bias = norms.get(LAYER_NORMS * i + 3), mlp_bias = norms.get(LAYER_NORMS * i + 4);
  const std::optional<at::Tensor> attn_out = norms.get(LAYER_NORMS * i + 5), mlp_out = norms.get(LAYER_NORMS * i + 6);
  TORCH_CHECK(attn_norm.has_value() && (mlp_norm.has_value() || l.parallel), who, ": the attention and MLP norms' "
              "weights are needed (only the qk-norm, a parallel block's MLP norm and LayerNorm biases may be None)");
  TORCH_CHECK(l.norm == NORM_LAYER || !(attn_bias || mlp_bias), who, ": only LayerNorms take biases");
  TORCH_CHECK(!mlp_bias || mlp_norm, who, ": an MLP norm's bias without its weight");
  l.attn_norm = *attn_norm;
  if (mlp_norm) l.mlp_norm = *mlp_norm;
  if (attn_bias) l.attn_norm_bias = *attn_bias;
  if (mlp_bias) l.mlp_norm_bias = *mlp_bias;
  if (attn_out) l.attn_out_norm = *attn_out;
  if (mlp_out) l.mlp_out_norm = *mlp_out;
  l.attn_eps = eps[LAYER_EPS * i];
  l.mlp_eps = eps[LAYER_EPS * i + 1];
  l.qk_eps = eps[LAYER_EPS * i + 2];
  l.attn_out_eps = eps[LAYER_EPS * i + 3];
  l.mlp_out_eps = eps[LAYER_EPS * i + 4];
  l.n_heads = heads[2 * i];
  l.n_kv_heads = heads[2 * i + 1];
  l.scale = scales[2 * i];
  l.residual_scale = scales[2 * i + 1];
  for (const at::Tensor* norm : {&l.attn_norm, &l.mlp_norm, &l.attn_out_norm, &l.mlp_out_norm})
    if (norm->defined()) check_norm_weight(*norm, hidden, who + ": the norms' weights", l.norm == NORM_RMS_FLOAT);
  for (const at::Tensor* bias : {&l.attn_norm_bias, &l.mlp_norm_bias})
    if (bias->defined()) check_norm_weight(*bias, hidden, who + ": the norms' biases");
  TORCH_CHECK(l.n_kv_heads >= 1 && l.n_heads % l.n_kv_heads == 0, who, ": ", l.n_heads,
              " query heads are not a multiple of ", l.n_kv_heads, " KV heads");
  if (qk_norm) {
    l.qk_norm = *qk_norm;
    TORCH_CHECK(l.qk_norm.dim() == 2 && l.qk_norm.size(0) == l.n_heads + l.n_kv_heads &&
                    l.qk_norm.size(1) == head_dim &&
                    (l.qk_norm.scalar_type() == at::kBFloat16 || l.qk_norm.scalar_type() == at::kFloat) &&
                    l.qk_norm.is_contiguous(),
                who, ": the qk-norm's weights must be contiguous bf16 or float32 [", l.n_heads + l.n_kv_heads, ", ",
                head_dim, "] (a row a query head, then a row a KV head), got ", l.qk_norm.scalar_type(), " ",
                l.qk_norm.sizes());
  }
}

// The stack of n = layers.size() layers from decode_layers' lists (layer i: norms 7i .. 7i + 6, eps 5i .. 5i + 4,
// linears 4i .. 4i + 3 of three tensors each, heads and scales 2i and 2i + 1, layout 4i .. 4i + 3; its mask and
// rotary rows those at mask_of[i] and rope_of[i] of a step's lists), for rows of `hidden` and heads of `head_dim`:
// every norm, linear and the head checked against them.
LayerStack layer_stack(at::IntArrayRef layers, const c10::List<std::optional<at::Tensor>>& norms,
                       at::ArrayRef<double> eps,
                       const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef kinds,
                       at::IntArrayRef groups, at::IntArrayRef heads, at::ArrayRef<double> scales,
                       at::IntArrayRef layouts, const c10::List<std::optional<at::Tensor>>& head, double head_eps,
                       int64_t head_norm, int64_t head_kind, int64_t head_group, int64_t hidden, int64_t head_dim,
                       at::IntArrayRef mask_of, at::IntArrayRef rope_of, const char* op) {
  const int64_t n = static_cast<int64_t>(layers.size());
  const int64_t got[] = {static_cast<int64_t>(norms.size()), static_cast<int64_t>(eps.size()),
                         static_cast<int64_t>(tensors.size()), static_cast<int64_t>(kinds.size()),
                         static_cast<int64_t>(groups.size()), static_cast<int64_t>(heads.size()),
                         static_cast<int64_t>(scales.size()), static_cast<int64_t>(layouts.size()),
                         static_cast<int64_t>(mask_of.size()), static_cast<int64_t>(rope_of.size())};
  const int64_t per_layer[] = {LAYER_NORMS, LAYER_EPS, LAYER_LINEARS * TENSORS_PER_LINEAR, LAYER_LINEARS,
                               LAYER_LINEARS, 2, 2, LAYER_LAYOUT, 1, 1};
  const char* const names[] = {"norms", "eps", "tensors", "kinds", "groups", "heads", "scales", "layouts",
                               "mask indices", "rotary indices"};
  check_list_sizes(n, got, per_layer, names, op);
  TORCH_CHECK(head_dim > 0 && head_dim_fits(head_dim), op, ": head_dim ", head_dim,
              "; the layers take a head_dim a multiple of 16 up to ", MAX_HEAD_DIM);
  LayerStack stack;
  stack.layers.assign(layers.begin(), layers.end());
  stack.mask_of.assign(mask_of.begin(), mask_of.end());
  stack.rope_of.assign(rope_of.begin(), rope_of.end());
  stack.hidden = hidden;
  stack.head_dim = head_dim;
  stack.calls.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const std::string who = std::string(op) + ": layer " + std::to_string(i);
    LayerCall& l = stack.calls[i];
    take_layer_norms(l, norms, eps, layouts, heads, scales, i, hidden, head_dim, who);
    l.linears = layer_linears(tensors, kinds, groups, i, who);
    check_layer_linears(l.linears, hidden, (l.n_heads + 2 * l.n_kv_heads) * head_dim, l.n_heads * head_dim, who,
                        l.gated);
    for (LayerLinear& linear : l.linears)
      if (linear.bias.defined()) linear.bias = linear.bias.to(at::kBFloat16).contiguous();
  }
  stack.head = head_call(head, head_eps, head_norm, head_kind, head_group, hidden, op);
  return stack;
}

// A step of the stack's layers on rows x [B, 1, hidden] (as decode_layers documents it; masks, cos and sin as the
// stack's mask_of and rope_of index them). Every layer's inputs are checked before any is run.
at::Tensor run_layer_stack(const LayerStack& stack, const at::Tensor& x, const at::Tensor& keys,
                           const at::Tensor& values, const at::Tensor& slots,
                           const c10::List<std::optional<at::Tensor>>& masks, int64_t kv_len,
                           const c10::List<std::optional<at::Tensor>>& cos,
                           const c10::List<std::optional<at::Tensor>>& sin, const char* op) {
  TORCH_CHECK(keys.dim() == 5 && values.dim() == 5, op, ": keys and values must be the whole cache [layers, B,"
              " kv_heads, L, head_dim], got ", keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(x.dim() == 3 && x.size(2) == stack.hidden && keys.size(4) == stack.head_dim, op, ": the layers take "
              "rows of ", stack.hidden, " and heads of ", stack.head_dim, ", got x ", x.sizes(), " and keys ",
              keys.sizes());
  TORCH_CHECK(cos.size() == sin.size(), op, ": ", cos.size(), " cos tables and ", sin.size(), " sin tables");
  const int64_t n = static_cast<int64_t>(stack.calls.size());
  const std::vector<LayerCall>& calls = stack.calls;
  std::vector<LayerInputs> inputs(n);
  for (int64_t i = 0; i < n; ++i) {
    const std::string who = std::string(op) + ": layer " + std::to_string(i);
    const int64_t layer = stack.layers[i], mask = stack.mask_of[i], rope = stack.rope_of[i];
    TORCH_CHECK(0 <= layer && layer < keys.size(0), who, ": cache layer ", layer, " outside 0 .. ", keys.size(0) - 1);
    TORCH_CHECK(0 <= mask && mask < static_cast<int64_t>(masks.size()) && 0 <= rope &&
                    rope < static_cast<int64_t>(cos.size()),
                who, ": mask ", mask, " and rotary table ", rope, " of ", masks.size(), " masks and ", cos.size(),
                " tables");
    LayerInputs& in = inputs[i];
    in.keys = keys.select(0, layer);
    in.values = values.select(0, layer);
    in.mask = masks.get(mask);
    in.cos = cos.get(rope);
    in.sin = sin.get(rope);
    check_layer_inputs(x, in.keys, in.values, slots, kv_len, in.cos, in.sin, calls[i].n_kv_heads, who);
    check_layer_mask(in.mask, x.size(0), kv_len, who);
  }
  const HeadCall& final_head = stack.head;
  // every buffer made before the layers run: the hidden states go back and forth between two, the last layer's into
  // the one returned
  const at::Tensor out = at::empty_like(x);
  const at::Tensor between[2] = {n > 1 ? at::empty_like(x) : at::Tensor(), n > 2 ? at::empty_like(x) : at::Tensor()};
  std::vector<LayerBuffers> buffers;
  std::vector<int64_t> buffers_of(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ffn = linear_shape(calls[i].linears[3]).second;
    if (buffers.empty() || !buffers.back().fits(calls[i], ffn, stack.head_dim))
      buffers.push_back(layer_buffers(x, calls[i], ffn, stack.head_dim, kv_len));
    buffers_of[i] = static_cast<int64_t>(buffers.size()) - 1;
  }
  const int64_t batch = x.size(0), hidden = x.size(2);
  const at::Tensor normed = final_head.given() ? at::empty({batch, hidden}, x.options()) : at::Tensor();
  const at::Tensor logits =
      final_head.given() ? at::empty({batch, linear_shape(final_head.linear).first}, x.options()) : at::Tensor();
  run_as_team([&] {
    const at::Tensor* h = &x;
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor* next = i == n - 1 ? &out : &between[i % 2];
      layer_step(*h, calls[i], inputs[i], slots, kv_len, buffers[buffers_of[i]], *next);
      h = next;
    }
    if (!final_head.given()) return;
    if (leads_team())
      norm_rows(final_head.norm_kind, out.data_ptr<at::BFloat16>(), batch, hidden, final_head.norm,
                final_head.norm_bias, final_head.eps, normed.data_ptr<at::BFloat16>());
    team_barrier();
    layer_gemv_into(final_head.linear, normed, logits);
  });
  return final_head.given() ? logits : out;
}

// decode_layers runs consecutive decoder layers (each as layer_step, above) on rows x [B, 1, hidden], one after
// another, in one call: a step's Python and dispatch per layer cost more than a small layer's weights take to read.
// Layer i reads and writes the KV cache's layer layers[i] (keys, values: the whole cache [cache layers, B, kv_heads,
// L, head_dim]); its mask, cos and sin are entry i of their lists, its norms entries 7i .. 7i + 6 of norms (the
// attention's weight, the MLP's (None in a parallel block whose MLP reads the attention's norm), the qk-norm's: None,
// or a bf16 (float32: scaled in float32) row a query head then a row a KV head, applied to each q and k head before
// rotary as the fused block's HeadRMSNorm does, then the two LayerNorm biases or None, then the norms of the
// attention's and the MLP's outputs or None) and their eps entries 5i .. 5i + 4 of eps, its layout
// entries 4i .. 4i + 3 of layouts (NormKind, MlpActivation, gated, parallel), its linears 4i .. 4i + 3 (three tensors
// each: weight, scales, bias), its query and KV heads entries 2i and 2i + 1 of heads, and of scales its attention's
// score scale and its residual scale (each branch's output times it before the residual add; 1: none). With a head
// (HeadCall) the call returns its logits [B, vocab], else the last layer's hidden states. Every layer and the head
// are checked before any is run.
at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& keys, const at::Tensor& values, at::IntArrayRef layers,
                         const at::Tensor& slots, const c10::List<std::optional<at::Tensor>>& masks, int64_t kv_len,
                         const c10::List<std::optional<at::Tensor>>& cos,
                         const c10::List<std::optional<at::Tensor>>& sin,
                         const c10::List<std::optional<at::Tensor>>& norms, at::ArrayRef<double> eps,
                         const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef kinds,
                         at::IntArrayRef groups, at::IntArrayRef heads, at::ArrayRef<double> scales,
                         at::IntArrayRef layouts, const c10::List<std::optional<at::Tensor>>& head,
                         double head_eps, int64_t head_norm, int64_t head_kind, int64_t head_group) {
  check_isa("decode_layers");
  const int64_t n = static_cast<int64_t>(layers.size());
  const int64_t got[] = {static_cast<int64_t>(masks.size()), static_cast<int64_t>(cos.size()),
                         static_cast<int64_t>(sin.size())};
  check_list_sizes(n, got, {1, 1, 1}, {"masks", "cos", "sin"}, "decode_layers");
  TORCH_CHECK(keys.dim() == 5 && values.dim() == 5 && x.dim() == 3, "decode_layers: keys and values must be the whole "
              "cache [layers, B, kv_heads, L, head_dim] and x [B, 1, hidden], got ", keys.sizes(), ", ",
              values.sizes(), " and ", x.sizes());
  std::vector<int64_t> each(n);
  std::iota(each.begin(), each.end(), 0);
  const LayerStack stack = layer_stack(layers, norms, eps, tensors, kinds, groups, heads, scales, layouts, head,
                                       head_eps, head_norm, head_kind, head_group, x.size(2), keys.size(4), each, each,
                                       "decode_layers");
  return run_layer_stack(stack, x, keys, values, slots, masks, kv_len, cos, sin, "decode_layers");
}

// decode_attention_half(x, keys, values, layer, slots, mask, kv_len, cos, sin, norms, eps, tensors, kinds, groups,
// heads, scale, residual_scale): the attention half of one layer's decode step (attention_step) for a layer whose
// MLP runs elsewhere (a mixture of experts' own module), its arguments as decode_layers takes one layer's but for two
// linears (qkv, o) and its two scales apart: returns the rows after the attention's residual add and their MLP norm,
// [B, 1, hidden] each. Its inputs are checked before the cache is written.
std::tuple<at::Tensor, at::Tensor> decode_attention_half(
    const at::Tensor& x, const at::Tensor& keys, const at::Tensor& values, int64_t layer, const at::Tensor& slots,
    const std::optional<at::Tensor>& mask, int64_t kv_len, const std::optional<at::Tensor>& cos,
    const std::optional<at::Tensor>& sin, const c10::List<std::optional<at::Tensor>>& norms, at::ArrayRef<double> eps,
    const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef kinds, at::IntArrayRef groups,
    at::IntArrayRef heads, double scale, double residual_scale) {
  const char* op = "decode_attention_half";
  check_isa(op);
  TORCH_CHECK(keys.dim() == 5 && values.dim() == 5 && x.dim() == 3, op, ": keys and values must be the whole cache "
              "[layers, B, kv_heads, L, head_dim] and x [B, 1, hidden], got ", keys.sizes(), ", ", values.sizes(),
              " and ", x.sizes());
  TORCH_CHECK(0 <= layer && layer < keys.size(0), op, ": cache layer ", layer, " outside 0 .. ", keys.size(0) - 1);
  const int64_t got[] = {static_cast<int64_t>(norms.size()), static_cast<int64_t>(eps.size()),
                         static_cast<int64_t>(tensors.size()), static_cast<int64_t>(kinds.size()),
                         static_cast<int64_t>(groups.size()), static_cast<int64_t>(heads.size())};
  const int64_t per_layer[] = {LAYER_NORMS, LAYER_EPS, 2 * TENSORS_PER_LINEAR, 2, 2, 2};
  const char* const names[] = {"norms", "eps", "tensors", "kinds", "groups", "heads"};
  check_list_sizes(1, got, per_layer, names, op);
  const int64_t hidden = x.size(2), head_dim = keys.size(4);
  TORCH_CHECK(head_dim > 0 && head_dim_fits(head_dim), op, ": head_dim ", head_dim,
              "; the layers take a head_dim a multiple of 16 up to ", MAX_HEAD_DIM);
  const std::string who = std::string(op) + ": layer " + std::to_string(layer);
  LayerCall l;
  const double scales[] = {scale, residual_scale};
  take_layer_norms(l, norms, eps, {}, heads, scales, 0, hidden, head_dim, who);  // RMSNorm, not parallel
  l.linears = layer_linears(tensors, kinds, groups, 0, who, 2);  // qkv, o
  check_layer_linears(l.linears, hidden, (l.n_heads + 2 * l.n_kv_heads) * head_dim, l.n_heads * head_dim, who);
  for (LayerLinear& linear : l.linears)
    if (linear.bias.defined()) linear.bias = linear.bias.to(at::kBFloat16).contiguous();
  const LayerInputs in{keys.select(0, layer), values.select(0, layer), mask, cos, sin};
  check_layer_inputs(x, in.keys, in.values, slots, kv_len, in.cos, in.sin, l.n_kv_heads, who);
  check_layer_mask(in.mask, x.size(0), kv_len, who);
  LayerBuffers b = layer_buffers(x, l, 0, head_dim, kv_len);
  const at::Tensor out = at::empty_like(x);
  run_as_team([&] { attention_step(x, l, in, slots, kv_len, b, out); });
  return {out, b.normed.view(x.sizes())};
}

// ---- a mixture of experts' routed experts for decode rows ----------------------------------------------------------
// experts_decode(x, index, weights, chosen, experts, tensors, kinds, groups): rows x [rows, hidden] bf16 through the
// experts each row was routed to (index [rows, k] into `experts` experts, an index past the last one skipped, as
// expert parallelism's "none here"), as transformers' eager experts forward computes them in bf16 with a SiLU gate:
// per expert, in ascending order, the rows routed to it gathered, gate_up GEMV, bf16(bf16(silu(gate)) * up), down
// GEMV, each row's result times its routing weight (weights [rows, k], float32 or bf16) rounded to bf16 and added into
// the row's sum (from zeros), rounded to bf16. `chosen` lists the experts the rows were routed to, ascending; the
// linears of chosen[i] are entries 2i and 2i + 1 of kinds and groups and three tensors each of `tensors` (weight,
// scales, bias), as decode_layers takes a layer's. One parallel region for every expert's GEMVs: with at least as many
// experts as threads each thread computes whole experts, else the threads share each expert's GEMVs.
at::Tensor experts_decode(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights,
                          at::IntArrayRef chosen, int64_t experts,
                          const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef kinds,
                          at::IntArrayRef groups) {
  check_isa("experts_decode");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
              "experts_decode: x must be contiguous bf16 [rows, hidden] on the CPU, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(index.dim() == 2 && index.size(0) == x.size(0) && index.scalar_type() == at::kLong,
              "experts_decode: index must be int64 [rows, k] for ", x.size(0), " rows, got ", index.sizes(), " ",
              index.scalar_type());
  TORCH_CHECK(weights.sizes() == index.sizes() &&
                  (weights.scalar_type() == at::kFloat || weights.scalar_type() == at::kBFloat16),
              "experts_decode: weights must be float32 or bf16 of index's shape ", index.sizes(), ", got ",
              weights.sizes(), " ", weights.scalar_type());
  const int64_t count = static_cast<int64_t>(chosen.size()), rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == 2 * count && groups.size() == kinds.size() &&
                  static_cast<int64_t>(tensors.size()) == 2 * count * TENSORS_PER_LINEAR,
              "experts_decode: two linears a chosen expert: kinds and groups of 2 x ", count, ", tensors of 6 x ",
              count, "; got ", kinds.size(), " kinds, ", groups.size(), " groups, ", tensors.size(), " tensors");
  TORCH_CHECK(experts >= 0, "experts_decode: experts must be a count, got ", experts);
  std::vector<int64_t> position(experts, -1);  // an expert's place in chosen
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(0 <= chosen[i] && chosen[i] < experts && (i == 0 || chosen[i - 1] < chosen[i]),
                "experts_decode: chosen must list experts of 0 .. ", experts - 1, " in ascending order, got ", chosen);
    position[chosen[i]] = i;
  }
  const at::Tensor picks = index.contiguous(), scale = weights.to(at::kFloat).contiguous();
  std::vector<std::vector<std::pair<int64_t, float>>> routed(count);  // per chosen expert: (row, routing weight)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < picks.size(1); ++j) {
      const int64_t e = picks.data_ptr<int64_t>()[r * picks.size(1) + j];
      TORCH_CHECK(e >= 0 && (e >= experts || position[e] >= 0), "experts_decode: row ", r, " picks expert ", e,
                  "; allowed: the chosen ", chosen, ", or ", experts, " and past (none here)");
      if (e < experts) routed[position[e]].emplace_back(r, scale.data_ptr<float>()[r * picks.size(1) + j]);
    }
  struct Routed {
    int64_t place, ffn;  // the expert's place in chosen
    LayerLinear up, down;
    at::Tensor rows_x, gate_up, act, out;
  };
  std::vector<Routed> work;
  for (int64_t p = 0; p < count; ++p) {
    if (routed[p].empty()) continue;
    const int64_t e = chosen[p];
    Routed w{p, 0, {}, {}, {}, {}, {}, {}};
    LayerLinear* pair[2] = {&w.up, &w.down};
    for (int64_t i = 0; i < 2; ++i) {
      const std::string who = "experts_decode: expert " + std::to_string(e) + (i ? "'s down" : "'s gate_up");
      pair[i]->kind = kinds[2 * p + i];
      pair[i]->group = groups[2 * p + i];
      take_linear_tensors(*pair[i], tensors, (2 * p + i) * TENSORS_PER_LINEAR, who);
      check_layer_linear(*pair[i], who);
    }
    w.ffn = linear_shape(w.down).second;
    TORCH_CHECK(linear_shape(w.up) == std::make_pair(2 * w.ffn, hidden) && linear_shape(w.down).first == hidden,
                "experts_decode: expert ", e, "'s linears are [", linear_shape(w.up).first, ", ",
                linear_shape(w.up).second, "] and [", linear_shape(w.down).first, ", ", w.ffn, "]; rows of ", hidden,
                " need [2 ffn, ", hidden, "] and [", hidden, ", ffn]");
    const int64_t m = static_cast<int64_t>(routed[p].size());
    bool in_order = m == rows;  // every row, each once and in order: x as it is
    for (int64_t i = 0; in_order && i < m; ++i) in_order = routed[p][i].first == i;
    w.rows_x = in_order ? x : at::empty({m, hidden}, x.options());
    w.gate_up = at::empty({m, 2 * w.ffn}, x.options());
    w.act = at::empty({m, w.ffn}, x.options());
    w.out = at::empty({m, hidden}, x.options());
    work.push_back(std::move(w));
  }
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const auto gather = [&](const Routed& w) {
    const std::vector<std::pair<int64_t, float>>& to = routed[w.place];
    if (!w.rows_x.is_same(x))
      for (size_t i = 0; i < to.size(); ++i)
        std::copy_n(xp + to[i].first * hidden, hidden, w.rows_x.data_ptr<at::BFloat16>() + i * hidden);
  };
  const int64_t threads = at::get_num_threads();
  if (static_cast<int64_t>(work.size()) >= threads || threads == 1 || at::in_parallel_region()) {
    // as many experts as threads, or more: each thread computes whole experts on its own (its kernels see the
    // parallel region and run on it alone), with no barrier between an expert's steps
    at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        Routed& w = work[i];
        gather(w);
        layer_gemv_into(w.up, w.rows_x, w.gate_up);
        silu_mul_rows(w.gate_up, w.ffn, w.act);
        layer_gemv_into(w.down, w.act, w.out);
      }
    });
  } else {
    run_as_team([&] {  // fewer experts than threads: every thread takes its share of each expert's GEMVs
      for (Routed& w : work) {
        if (leads_team()) gather(w);
        team_barrier();
        layer_gemv_into(w.up, w.rows_x, w.gate_up);
        silu_mul_rows(w.gate_up, w.ffn, w.act);
        team_barrier();
        layer_gemv_into(w.down, w.act, w.out);
      }
    });
  }
  at::Tensor sums = at::zeros({rows, hidden}, x.options());
  at::BFloat16* sp = sums.data_ptr<at::BFloat16>();
  for (const Routed& w : work) {  // in ascending expert order, as transformers adds them
    const std::vector<std::pair<int64_t, float>>& to = routed[w.place];
    for (size_t i = 0; i < to.size(); ++i) {
      at::BFloat16* sum = sp + to[i].first * hidden;
      const at::BFloat16* out = w.out.data_ptr<at::BFloat16>() + i * hidden;
      for (int64_t c = 0; c < hidden; ++c)
        sum[c] = at::BFloat16(static_cast<float>(sum[c]) +
                              static_cast<float>(at::BFloat16(static_cast<float>(out[c]) * to[i].second)));
    }
  }
  return sums;
}

// Stacks kept by register_layers, by number, until release_layers.
std::mutex registered_stacks_mutex;
std::unordered_map<int64_t, std::shared_ptr<const LayerStack>> registered_stacks;
int64_t next_stack_number = 1;

// decode_layers' unchanging arguments, checked and kept for decode_registered calls (layer i takes mask mask_of[i] and
// rotary table rope_of[i] of a call's lists); returns the stack's number. It holds the tensors until release_layers.
int64_t register_layers(at::IntArrayRef layers, const c10::List<std::optional<at::Tensor>>& norms,
                        at::ArrayRef<double> eps,
                        const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef kinds,
                        at::IntArrayRef groups, at::IntArrayRef heads, at::ArrayRef<double> scales,
                        at::IntArrayRef layouts, const c10::List<std::optional<at::Tensor>>& head, double head_eps,
                        int64_t head_norm, int64_t head_kind, int64_t head_group, int64_t hidden, int64_t head_dim,
                        at::IntArrayRef mask_of, at::IntArrayRef rope_of) {
  auto stack = std::make_shared<const LayerStack>(layer_stack(layers, norms, eps, tensors, kinds, groups, heads,
                                                              scales, layouts, head, head_eps, head_norm, head_kind,
                                                              head_group, hidden, head_dim, mask_of, rope_of,
                                                              "register_layers"));
  const std::lock_guard<std::mutex> lock(registered_stacks_mutex);
  const int64_t number = next_stack_number++;
  registered_stacks.emplace(number, std::move(stack));
  return number;
}

// The stack registered as `number`, held for the caller even if released meanwhile.
std::shared_ptr<const LayerStack> registered_stack(int64_t number, const char* op) {
  const std::lock_guard<std::mutex> lock(registered_stacks_mutex);
  const auto found = registered_stacks.find(number);
  TORCH_CHECK(found != registered_stacks.end(), op, ": no layers registered as ", number,
              " (never registered, or released)");
  return found->second;
}

// A decode step of registered layers: decode_layers' result, with masks, cos and sin as the stack indexes them.
at::Tensor decode_registered(const at::Tensor& x, const at::Tensor& keys, const at::Tensor& values, int64_t stack,
                             const at::Tensor& slots, const c10::List<std::optional<at::Tensor>>& masks,
                             int64_t kv_len, const c10::List<std::optional<at::Tensor>>& cos,
                             const c10::List<std::optional<at::Tensor>>& sin) {
  check_isa("decode_registered");
  const std::shared_ptr<const LayerStack> layers = registered_stack(stack, "decode_registered");
  return run_layer_stack(*layers, x, keys, values, slots, masks, kv_len, cos, sin, "decode_registered");
}

void release_layers(int64_t stack) {
  const std::lock_guard<std::mutex> lock(registered_stacks_mutex);
  TORCH_CHECK(registered_stacks.erase(stack) == 1, "release_layers: no layers registered as ", stack);
}

// Greedy decoding's next `steps` tokens through registered layers that end with the model's head, each step as
// generate's loop takes it: the rows' positions [B, 1] and the shared slot [1] one further, the slot marked as holding
// a real token in every row of valid [B, L], each row's last token (sequences [B, S] at column kv_len - 1) looked up in
// embedding [vocab, hidden] (times embed_scale as a float32, each product rounded to bf16 as torch rounds a bf16
// tensor times a float: a caller whose model rounds its scale to bf16 first, as Gemma's, passes it so), its rotary
// rows read from each table (cos, sin [positions, rotary]; no tables without rotary) at the row's position, the layers
// and head run (decode_registered) and the pick written at column kv_len (greedy_next; while kv_len is below
// eos_banned_below, no eos id is picked: Hugging Face's minimum lengths), kv_len one further each step. Each of the
// stack's masks is the one StaticKVCache.mask makes (the real slots, within its window: windows[m], 0 for none), or
// none where every row sees every slot: the first `filled` slots hold real tokens in every row (StaticKVCache.filled,
// which a step's slot extends where it is the next one) and the window takes them all. Stops once no row is
// unfinished. Returns the last step's tokens [B], the rows still unfinished, the steps taken and `filled` after them.
// Between steps generate's loop makes a dozen torch calls, each slow to start after a step has streamed the weights
// through the caches.
std::tuple<at::Tensor, int64_t, int64_t, int64_t> decode_greedy(
    const at::Tensor& embedding, std::optional<double> embed_scale, at::Tensor& keys, at::Tensor& values,
    int64_t stack, at::Tensor& slot, at::Tensor& valid, int64_t filled, at::IntArrayRef windows,
    at::Tensor& positions, at::TensorList cos_tables, at::TensorList sin_tables, at::Tensor& sequences, int64_t kv_len,
    at::Tensor& unfinished, const std::optional<at::Tensor>& eos, int64_t pad, int64_t eos_banned_below,
    int64_t steps) {
  check_isa("decode_greedy");
  const std::shared_ptr<const LayerStack> layers = registered_stack(stack, "decode_greedy");
  TORCH_CHECK(layers->head.given(), "decode_greedy: the registered layers must end with the model's head");
  const int64_t batch = sequences.size(0), hidden = layers->hidden, vocab = embedding.size(0);
  TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == hidden && embedding.scalar_type() == at::kBFloat16 &&
                  embedding.is_contiguous() && embedding.device().is_cpu(),
              "decode_greedy: embedding must be a contiguous bf16 CPU tensor [vocab, ", hidden, "], got ",
              embedding.scalar_type(), " ", embedding.sizes());
  TORCH_CHECK(sequences.dim() == 2 && sequences.scalar_type() == at::kLong && sequences.is_contiguous() && steps >= 1 &&
                  1 <= kv_len && kv_len + steps <= sequences.size(1),
              "decode_greedy: sequences must be contiguous int64 [B, S] with columns kv_len - 1 .. kv_len + steps - 1 "
              "inside, got ", sequences.sizes(), " with kv_len ", kv_len, " and ", steps, " steps");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 2 &&
                  positions.size(0) == batch && positions.size(1) == 1,
              "decode_greedy: positions must be contiguous int64 [", batch, ", 1], got ", positions.sizes());
  TORCH_CHECK(slot.scalar_type() == at::kLong && slot.dim() == 1 && slot.numel() == 1,
              "decode_greedy: slot must be int64 [1] (one slot the rows share), got ", slot.sizes());
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.dim() == 2 && valid.size(0) == batch &&
                  valid.size(1) == keys.size(3) && valid.is_contiguous(),
              "decode_greedy: valid must be contiguous bool [", batch, ", ", keys.size(3), "], got ", valid.sizes());
  TORCH_CHECK(!eos || (eos->dim() == 1 && eos->scalar_type() == at::kLong && eos->is_contiguous()),
              "decode_greedy: eos must be contiguous int64 ids [n], got ", eos ? eos->sizes() : at::IntArrayRef());
  TORCH_CHECK(unfinished.dim() == 1 && unfinished.size(0) == batch && unfinished.scalar_type() == at::kLong &&
                  unfinished.is_contiguous(),
              "decode_greedy: unfinished must be contiguous int64 [", batch, "], got ", unfinished.sizes());
  int64_t tables = 0;
  for (const int64_t rope : layers->rope_of) tables = std::max(tables, rope + 1);
  TORCH_CHECK((cos_tables.empty() || static_cast<int64_t>(cos_tables.size()) == tables) &&
                  sin_tables.size() == cos_tables.size(),
              "decode_greedy: the layers read ", tables, " rotary tables (or none, without rotary), got ",
              cos_tables.size(), " cos and ", sin_tables.size(), " sin tables");
  for (size_t t = 0; t < cos_tables.size(); ++t)
    TORCH_CHECK(cos_tables[t].dim() == 2 && cos_tables[t].sizes() == sin_tables[t].sizes() &&
                    cos_tables[t].scalar_type() == at::kBFloat16 && sin_tables[t].scalar_type() == at::kBFloat16 &&
                    cos_tables[t].is_contiguous() && sin_tables[t].is_contiguous(),
                "decode_greedy: rotary table ", t, " must be contiguous bf16 cos and sin [positions, rotary], got ",
                cos_tables[t].sizes(), " and ", sin_tables[t].sizes());
  int64_t masks_read = 0;
  for (const int64_t mask : layers->mask_of) masks_read = std::max(masks_read, mask + 1);
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == masks_read &&
                  std::all_of(windows.begin(), windows.end(), [](int64_t w) { return w >= 0; }),
              "decode_greedy: the layers read ", masks_read, " masks: one window each (0 for none), got ", windows);
  // every step's inputs in buffers made once
  const at::Tensor x = at::empty({batch, 1, hidden}, embedding.options());
  c10::List<std::optional<at::Tensor>> cos, sin;
  for (int64_t t = 0; cos_tables.empty() && t < tables; ++t) {
    cos.push_back(std::nullopt);
    sin.push_back(std::nullopt);
  }
  for (size_t t = 0; t < cos_tables.size(); ++t) {
    cos.push_back(at::empty({batch, 1, 1, cos_tables[t].size(1)}, cos_tables[t].options()));
    sin.push_back(at::empty({batch, 1, 1, cos_tables[t].size(1)}, cos_tables[t].options()));
  }
  const at::Tensor step_slot = at::empty({1}, slot.options());
  const float scale = static_cast<float>(embed_scale.value_or(1.0));
  int64_t* pp = positions.data_ptr<int64_t>();
  int64_t* slot_p = slot.data_ptr<int64_t>();
  bool* vp = valid.data_ptr<bool>();
  const int64_t* seq = sequences.data_ptr<int64_t>();
  const int64_t columns = sequences.size(1), slots = valid.size(1);
  at::Tensor tokens;
  int64_t running = 0, taken = 0;
  while (taken < steps) {
    // each step's inputs checked before anything is written: a refused step leaves the earlier steps' state
    const int64_t kv = kv_len + taken, q = kv - 1;
    TORCH_CHECK(*slot_p + 1 == q, "decode_greedy: slot ", *slot_p, " + 1 is not the step's last of ", kv, " slots");
    TORCH_CHECK(kv <= slots, "decode_greedy: ", kv, " slots past the cache's ", slots);
    const int64_t filled_now = filled > 0 && q == filled ? filled + 1 : filled;
    c10::List<std::optional<at::Tensor>> masks;
    for (const int64_t window : windows) {
      if (kv <= filled_now && (window == 0 || kv <= window)) {
        masks.push_back(std::nullopt);
        continue;
      }
      const at::Tensor mask = at::empty({batch, 1, 1, kv}, valid.options());
      bool* mp = mask.data_ptr<bool>();
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t k = 0; k < kv; ++k)
          mp[b * kv + k] = (k == q || vp[b * slots + k]) && (window == 0 || k > q - window);
      masks.push_back(mask);
    }
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t token = seq[b * columns + kv - 1], position = pp[b] + 1;
      TORCH_CHECK(0 <= token && token < vocab, "decode_greedy: token ", token, " outside the embedding's 0 .. ",
                  vocab - 1);
      const at::BFloat16* row = embedding.data_ptr<at::BFloat16>() + token * hidden;
      at::BFloat16* xp = x.data_ptr<at::BFloat16>() + b * hidden;
      if (embed_scale)
        for (int64_t i = 0; i < hidden; ++i) xp[i] = static_cast<float>(row[i]) * scale;
      else
        std::copy(row, row + hidden, xp);
      for (size_t t = 0; t < cos_tables.size(); ++t) {
        const int64_t rotary = cos_tables[t].size(1);
        TORCH_CHECK(0 <= position && position < cos_tables[t].size(0), "decode_greedy: position ", position,
                    " outside rotary table ", t, "'s 0 .. ", cos_tables[t].size(0) - 1);
        std::copy_n(cos_tables[t].data_ptr<at::BFloat16>() + position * rotary, rotary,
                    cos.get(t)->data_ptr<at::BFloat16>() + b * rotary);
        std::copy_n(sin_tables[t].data_ptr<at::BFloat16>() + position * rotary, rotary,
                    sin.get(t)->data_ptr<at::BFloat16>() + b * rotary);
      }
    }
    *step_slot.data_ptr<int64_t>() = kv - 1;
    const at::Tensor logits =
        run_layer_stack(*layers, x, keys, values, step_slot, masks, kv, cos, sin, "decode_greedy");
    *slot_p = q;
    filled = filled_now;
    for (int64_t b = 0; b < batch; ++b) {
      vp[b * slots + q] = true;
      pp[b] += 1;
    }
    if (kv < eos_banned_below && eos) {
      at::BFloat16* lp = logits.data_ptr<at::BFloat16>();
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t i = 0; i < eos->numel(); ++i) {
          const int64_t id = eos->data_ptr<int64_t>()[i];
          if (0 <= id && id < logits.size(1)) lp[b * logits.size(1) + id] = -std::numeric_limits<float>::infinity();
        }
    }
    std::tie(tokens, running) = greedy_next(logits, sequences, kv, unfinished, eos, pad);
    ++taken;
    if (running == 0) break;
  }
  return {tokens, running, taken, filled};
}

int64_t registered_layer_stacks() {
  const std::lock_guard<std::mutex> lock(registered_stacks_mutex);
  return static_cast<int64_t>(registered_stacks.size());
}

}  // namespace

TORCH_LIBRARY(splice_kernels, lib) {
  lib.def("bf16_gemv(Tensor x, Tensor w) -> Tensor");
  lib.def("int8_gemv(Tensor x, Tensor w, Tensor scales) -> Tensor");
  lib.def("int8_dot_gemv(Tensor x, Tensor w, Tensor scales) -> Tensor");
  lib.def("int8_dot_gemv_grouped(Tensor x, Tensor w, Tensor scales) -> Tensor");
  lib.def("int8_dot16_gemv(Tensor x, Tensor w, Tensor scales) -> Tensor");
  lib.def("int8_dot16_gemv_grouped(Tensor x, Tensor w, Tensor scales) -> Tensor");
  lib.def("int4_gemv(Tensor x, Tensor w, int group) -> Tensor");
  lib.def("int4_dot_gemv(Tensor x, Tensor w, int group) -> Tensor");
  lib.def("stream_read(Tensor t, int streams=4, bool prefetch=True) -> int");
  lib.def("gptq_columns(Tensor(a!) w, Tensor hinv, int first, int end, Tensor scales, Tensor zeros, "
          "Tensor(b!) codes, Tensor(c!) errors) -> ()");
  lib.def("int4_dequantize(Tensor w, int group) -> Tensor");
  lib.def("int8_linear(Tensor x, Tensor w, Tensor scales, bool widen=False) -> Tensor");
  lib.def("int4_linear(Tensor x, Tensor w, int group, bool widen=False) -> Tensor");
  lib.def("widened_linear(Tensor x, Tensor w) -> Tensor");
  lib.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  lib.def("decode_attention_sinks(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, Tensor sinks) -> Tensor");
  lib.def("argmax_rows(Tensor x) -> Tensor");
  lib.def("greedy_next(Tensor logits, Tensor(a!) sequences, int column, Tensor(b!) unfinished, Tensor? eos, int pad) "
          "-> (Tensor, int)");
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("decode_attention_half(Tensor x, Tensor(a!) keys, Tensor(b!) values, int layer, Tensor slots, "
          "Tensor? mask, int kv_len, Tensor? cos, Tensor? sin, Tensor?[] norms, float[] eps, Tensor?[] tensors, "
          "int[] kinds, int[] groups, int[] heads, float scale, float residual_scale) -> (Tensor, Tensor)");
  lib.def("experts_decode(Tensor x, Tensor index, Tensor weights, int[] chosen, int experts, Tensor?[] tensors, "
          "int[] kinds, int[] groups) -> Tensor");
  lib.def("decode_layers(Tensor x, Tensor(a!) keys, Tensor(b!) values, int[] layers, Tensor slots, Tensor?[] masks, "
          "int kv_len, Tensor?[] cos, Tensor?[] sin, Tensor?[] norms, float[] eps, Tensor?[] tensors, int[] kinds, "
          "int[] groups, int[] heads, float[] scales, int[] layouts, Tensor?[] head, float head_eps, int head_norm, "
          "int head_kind, int head_group) -> Tensor");
  lib.def("decode_registered(Tensor x, Tensor(a!) keys, Tensor(b!) values, int stack, Tensor slots, Tensor?[] masks, "
          "int kv_len, Tensor?[] cos, Tensor?[] sin) -> Tensor");
  lib.def("decode_greedy(Tensor embedding, float? embed_scale, Tensor(a!) keys, Tensor(b!) values, int stack, "
          "Tensor(c!) slot, Tensor(d!) valid, int filled, int[] windows, Tensor(e!) positions, Tensor[] cos, "
          "Tensor[] sin, Tensor(f!) sequences, int kv_len, Tensor(g!) unfinished, Tensor? eos, int pad, "
          "int eos_banned_below, int steps) -> (Tensor, int, int, int)");
  // keeps tensors, computes nothing: one kernel for every backend
  lib.def("register_layers(int[] layers, Tensor?[] norms, float[] eps, Tensor?[] tensors, int[] kinds, int[] groups, "
          "int[] heads, float[] scales, int[] layouts, Tensor?[] head, float head_eps, int head_norm, int head_kind, "
          "int head_group, int hidden, int head_dim, int[] mask_of, int[] rope_of) -> int", &register_layers);
  // no tensors: one kernel for every backend
  lib.def("release_layers(int stack) -> ()", &release_layers);
  lib.def("registered_layer_stacks() -> int", &registered_layer_stacks);
  lib.def("amx_ready() -> bool", &amx_ready);
  lib.def("int8_dot_ready() -> bool", &int8_dot_ready);
  lib.def("int4_dot_ready() -> bool", &int4_dot_ready);
  lib.def("vnni_ready() -> bool", &vnni_ready);
  lib.def("int8_tiles_ready() -> bool", &int8_tiles_ready);
  lib.def("avx_vnni_ready() -> bool", &avx_vnni_ready);
  lib.def("set_avx_vnni(bool on) -> ()", &set_avx_vnni);
  lib.def("isa() -> int", &isa);
  lib.def("best_isa() -> int", &best_isa);
  lib.def("set_isa(int level) -> ()", &set_isa);
  lib.def("amx_thresholds() -> int[]", &amx_thresholds);
  lib.def("prefill_buffer_bytes() -> int", &prefill_buffer_bytes);
  lib.def("release_prefill_buffer() -> ()", &release_prefill_buffer);
  lib.def("weight_streams() -> int", &weight_streams);
  lib.def("set_weight_streams(int streams) -> ()", &set_weight_streams);
  lib.def("work_stealing() -> bool", &work_stealing);
  lib.def("set_work_stealing(bool on) -> ()", &set_work_stealing);
  lib.def("layer_region() -> bool", &layer_region);
  lib.def("set_layer_region(bool on) -> ()", &set_layer_region);
  lib.def("software_prefetch() -> int", &software_prefetch);
  lib.def("set_software_prefetch(int kinds) -> ()", &set_software_prefetch);
  lib.def("software_prefetch_rows() -> int[]", &software_prefetch_rows);
  lib.def("set_software_prefetch_rows(int[] rows) -> ()", &set_software_prefetch_rows);
}

TORCH_LIBRARY_IMPL(splice_kernels, CPU, lib) {
  lib.impl("bf16_gemv", &bf16_gemv);
  lib.impl("int8_gemv", &int8_gemv);
  lib.impl("int8_dot_gemv", &int8_dot_gemv);
  lib.impl("int8_dot_gemv_grouped", &int8_dot_gemv_grouped);
  lib.impl("int8_dot16_gemv", &int8_dot16_gemv);
  lib.impl("int8_dot16_gemv_grouped", &int8_dot16_gemv_grouped);
  lib.impl("int4_gemv", &int4_gemv);
  lib.impl("stream_read", &stream_read);
  lib.impl("gptq_columns", &gptq_columns);
  lib.impl("int4_dot_gemv", &int4_dot_gemv);
  lib.impl("int4_dequantize", &int4_dequantize);
  lib.impl("int8_linear", &int8_linear);
  lib.impl("int4_linear", &int4_linear);
  lib.impl("widened_linear", &widened_linear);
  lib.impl("decode_attention", &decode_attention);
  lib.impl("decode_attention_sinks", &decode_attention_sinks);
  lib.impl("argmax_rows", &argmax_rows);
  lib.impl("greedy_next", &greedy_next);
  lib.impl("decode_layers", &decode_layers);
  lib.impl("experts_decode", &experts_decode);
  lib.impl("decode_attention_half", &decode_attention_half);
  lib.impl("rms_norm", &rms_norm);
  lib.impl("decode_registered", &decode_registered);
  lib.impl("decode_greedy", &decode_greedy);
}
