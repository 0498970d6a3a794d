// The 3×TF32 GEMM behind kernels/gemm_tf32x3.h on wgmma (sm_90a), warp-specialized and persistent. Two producer
// warpgroups bring each k-tile (32 deep) of A and B into shared memory: A by tensor copies (TMA) straight into the
// stage the consumers read (one 128 × 32 box where A is k-contiguous, four 32 × 32 boxes along m where it is
// m-contiguous), B raw with cp.async several k-tiles ahead; they then read B back k-contiguous (transposing it where
// it is stored the other way), split every value into its TF32 big and small parts and store both into the K-major,
// 128-byte-swizzled layout that wgmma's descriptors read. Where a weight's TF32 parts come split already
// (Tf32x3Planes, split once a step rather than by every block of every product), one producer thread brings both
// parts by tensor copies beside A, and the stages take the raw slots' shared memory. Two consumer warpgroups each load
// their 64 rows of A from the stage into registers (reading an m-contiguous A across its boxes), split them there,
// and issue three wgmma per k-step of 8 (small·big, big·small, big·big) with A from registers and B from shared
// memory; the `tf32` precision's plain products with A k-contiguous issue one wgmma a k-step with both operands from
// shared memory, the k-tiles of a tile chained. Where A is k-contiguous (the forward and backward-data products,
// whose outputs are large against their short sums) a consumer hands a finished tile to tensor stores (TMA) in boxes
// of 64 × 32 through two shared-memory buffers and goes on to the next tile while they drain.
// Stages change hands through mbarriers: FULL(s) completes when every producer thread has stored its part of stage s
// and A's tensor copies into it have landed, EMPTY(s) when every consumer thread is done with it. Unlike a named
// barrier, waiting on an mbarrier does not arrive on it, so each consumer warpgroup runs at its own pace, up to the
// stage count ahead of the other. Every thread arrives itself: compute-sanitizer's racecheck reports hazards where
// one lane per warp arrives after __syncwarp, an ordering it does not follow (as it does not follow bar.arrive →
// bar.sync; bench/racecheck_probe.cu). Blocks walk the output tiles (times the batch or the row slices) in a
// grid-stride loop, consecutive tiles along one row band, so the producers load the next tile while the consumers
// store the last one.
#include "kernels/gemm_tf32x3.h"

#include <algorithm>

#include <cuda.h>  // CUtensorMap
#include <cudaTypedefs.h>

#include "kernels/common.cuh"
#include "kernels/mbarrier.cuh"
#include "kernels/tf32x3.cuh"

namespace perception::kernels {
namespace {

constexpr int kBk = 32;                   // k per stage: one 128-byte swizzle row of float32
constexpr int kBm = 128;                  // block tile rows: two consumer warpgroups of 64
// Two producer warpgroups: one alone, a single warp per scheduler, left the consumers waiting on its latencies.
constexpr int kProducerThreads = 2 * 128;
constexpr int kThreads = kProducerThreads + 2 * 128;  // producers, consumer 0, consumer 1
// Registers per thread after the start (setmaxnreg): a consumer of a 128-column tile holds its accumulator, its
// k-tile's partial sum and its split A fragments; the producers need few. 256·48 + 256·208 = 65,536, the register
// file.
constexpr int kProducerRegisters = 48, kConsumerRegisters = 208;
constexpr int kRowBytes = kBk * 4;
constexpr int kStageBudget = 224 * 1024;  // shared memory for the stages (the H200 allows 227 KB per block)
// The output's tensor-store boxes: a consumer warpgroup's 64 rows by one 128-byte swizzle row of columns.
constexpr int kOutRows = 64, kOutCols = kBk, kOutBoxBytes = kOutRows * kRowBytes;
// An m-contiguous A's tensor-copy boxes: 32 of m (one 128-byte swizzle row) by the k-tile's kBk rows.
constexpr int kMBox = 32, kMBoxBytes = kBk * kRowBytes;
// Named barriers (0 is __syncthreads's): the producers' own, then each consumer warpgroup's (Layout::OutBarrier).
constexpr int kProducerBarrier = 1;
// How a tile reaches the output: st.global from registers (any beta), a tensor store (beta 0) or a tensor reduce-add
// (beta 1, y += the tile; the L2's float32 add flushes subnormal results to zero).
enum class StoreMode : int { kRegisters, kTensor, kTensorAdd };
// The fewest k-tiles a row slice gets, so the pipeline's fill stays small against its steady state.
constexpr int kMinSliceTiles = 8;
// What one work item (a tile of one slice) of the weight gradient costs beyond its k-tiles, in k-tiles: the
// pipeline's fill and the partial's store.
constexpr int kItemOverheadTiles = 2;

// C = A·B (+ bias + beta·C) with A [m, k] and B [k, n] as the template's layouts say, `count` times: the z-th reads
// and writes each operand at its pointer + z·stride, and with k_split > 0 covers k in [z·k_split, min(k,
// (z+1)·k_split)) (the strides then step along k).
struct GemmParams {
  const float* a;
  int64_t lda, stride_a;
  const float* b;
  int64_t ldb, stride_b;
  float* c;
  int64_t ldc, stride_c;
  const float* bias;
  int64_t stride_bias;
  float beta;
  int m, n, k, k_split;
};

__device__ __forceinline__ void CopyAsync16(uint32_t dst, const float* src, bool valid) {
  // src-size 0 reads nothing and zero-fills: out-of-range rows and k contribute zeros.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Byte offset of (row, k) in a K-major tile with the 128-byte swizzle: the 16-byte chunk index (k / 4) is XORed
// with row % 8 (PTX ISA, "Shared memory matrix layout", swizzle mode 128B); 8-row groups are 1,024 bytes apart.
__device__ __forceinline__ uint32_t Swizzled(int row, int k) {
  return row * kRowBytes + ((((k >> 2) ^ row) & 7) << 4) + (k & 3) * 4;
}

// A wgmma shared-memory descriptor for a K-major 128-byte-swizzled operand at `address` (1,024-byte aligned, or
// advanced from such an address by a k offset inside the swizzle row): stride 1,024 bytes between 8-row groups; the
// leading offset is unused for swizzled K-major layouts.
__device__ __forceinline__ uint64_t Descriptor(uint32_t address) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | static_cast<uint64_t>(1) << 16 |
         static_cast<uint64_t>(1024 >> 4) << 32 | static_cast<uint64_t>(1) << 62;
}

template <int kCount>
__device__ __forceinline__ void BarSync(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kCount) : "memory");
}

// The box of `map` at (x0, x1, x2) into shared memory at `dst`, completing `bytes` on the mbarrier `bar`.
__device__ __forceinline__ void TensorCopy(uint32_t dst, const CUtensorMap& map, int x0, int x1, int x2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(x0), "r"(x1), "r"(x2), "r"(bar)
      : "memory");
}
// Brings the descriptor `map` into the tensor copies' cache ahead of its first copy.
__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}
// The box at `src` into the tensor of `map` at (x0, x1, x2), stored or added; one bulk group per call.
__device__ __forceinline__ void TensorStore(StoreMode mode, const CUtensorMap& map, uint32_t src, int x0, int x1,
                                            int x2) {
  const uint64_t m = reinterpret_cast<uint64_t>(&map);
  if (mode == StoreMode::kTensorAdd) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(m),
                 "r"(src), "r"(x0), "r"(x1), "r"(x2)
                 : "memory");
  } else {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(m), "r"(src),
                 "r"(x0), "r"(x1), "r"(x2)
                 : "memory");
  }
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Keeps the compiler from moving accesses to an accumulator across the asynchronous wgmma that owns it.
__device__ __forceinline__ void FenceOperand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void FenceRegister(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// The accumulator of an m64nNk8 wgmma: its N/2 registers a thread as asm operands 0 … N/2 − 1, and their names in
// the instruction (each Run below adds A, B and scale_d after them).
#define PERCEPTION_WGMMA_D32 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define PERCEPTION_WGMMA_D64 \
    PERCEPTION_WGMMA_D32, \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define PERCEPTION_WGMMA_NAMES32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PERCEPTION_WGMMA_NAMES64 \
    PERCEPTION_WGMMA_NAMES32 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// d (+)= A·B over one k-step of 8 for a 64×N tile, A from registers (a[i] = row 16w + g + 8·(i % 2), k t + 4·(i / 2)
// for warp w of the warpgroup, g = lane / 4, t = lane % 4), B from a shared-memory descriptor; scale_d = 0 ignores d.
// d's layout: d[4j + 2h + e] = (row 16w + g + 8h, column 8j + 2t + e).
template <int N>
struct Wgmma;
template <>
struct Wgmma<64> {
  __device__ static void Run(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {" PERCEPTION_WGMMA_NAMES32
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : PERCEPTION_WGMMA_D32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
  }
  // A from shared memory (K-major, 128-byte swizzled, as B): the tensor cores read its float32 bits as TF32.
  __device__ static void Run(float (&d)[32], uint64_t a, uint64_t b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {" PERCEPTION_WGMMA_NAMES32
                 "}, %32, %33, p, 1, 1;\n}\n"
                 : PERCEPTION_WGMMA_D32
                 : "l"(a), "l"(b), "r"(scale_d));
  }
};
template <>
struct Wgmma<128> {
  __device__ static void Run(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {" PERCEPTION_WGMMA_NAMES64
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : PERCEPTION_WGMMA_D64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
  }
  // A from shared memory (K-major, 128-byte swizzled, as B): the tensor cores read its float32 bits as TF32.
  __device__ static void Run(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {" PERCEPTION_WGMMA_NAMES64
                 "}, %64, %65, p, 1, 1;\n}\n"
                 : PERCEPTION_WGMMA_D64
                 : "l"(a), "l"(b), "r"(scale_d));
  }
};
#undef PERCEPTION_WGMMA_D32
#undef PERCEPTION_WGMMA_D64
#undef PERCEPTION_WGMMA_NAMES32
#undef PERCEPTION_WGMMA_NAMES64

// B's k-tile: X columns by kBk. Copied raw in 16-byte pieces as global memory holds it, k-contiguous ([x][kBk],
// swizzled as below) or x-contiguous ([kBk][X]); read back as 4 consecutive k of one x (one 16-byte load, or four
// 4-byte loads down the columns of an x-contiguous tile, consecutive lanes on consecutive x), split into its big and
// small parts and stored into the swizzled K-major layout. Both passes are free of bank conflicts.
template <int X, bool kKContiguous>
struct Operand {
  static constexpr int kPieces = X * kBk / 4 / kProducerThreads;  // per producer thread
  static constexpr int kRawBytes = X * kRowBytes;

  // Zero past x_end or k_end: operands are contiguous in 4-float runs wholly in range or wholly out.
  __device__ static void Fetch(uint32_t raw, const float* g, int64_t ld, int x0, int x_end, int k0, int k_end,
                               int tid) {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int id = tid + kProducerThreads * i;
      // k-contiguous: 8 threads per row's 128 bytes; x-contiguous: consecutive threads along x.
      const int x = kKContiguous ? id / 8 : id % (X / 4) * 4;
      const int k = kKContiguous ? id % 8 * 4 : id / (X / 4);
      const int gx = x0 + x, gk = k0 + k;
      const bool valid = gx < x_end && gk < k_end;
      const uint32_t at = raw + (kKContiguous ? Swizzled(x, k) : (k * X + x) * 4);
      CopyAsync16(at, valid ? g + (kKContiguous ? gx * ld + gk : gk * ld + gx) : g, valid);
    }
  }
  // Split into big and small (kPlain: big alone, B rounded to TF32).
  template <bool kPlain>
  __device__ static void Store(const unsigned char* raw, unsigned char* big, unsigned char* small, int tid) {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int id = tid + kProducerThreads * i;
      const int x = kKContiguous ? id / 8 : id % X;
      const int k = kKContiguous ? id % 8 * 4 : id / X * 4;
      float f[4];
      if (kKContiguous) {
        const float4 v = *reinterpret_cast<const float4*>(raw + Swizzled(x, k));
        f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) f[e] = reinterpret_cast<const float*>(raw)[(k + e) * X + x];
      }
      uint4 b, s;
      Tf32Split split = SplitTf32ForMma(f[0]);
      b.x = split.big, s.x = split.small;
      split = SplitTf32ForMma(f[1]);
      b.y = split.big, s.y = split.small;
      split = SplitTf32ForMma(f[2]);
      b.z = split.big, s.z = split.small;
      split = SplitTf32ForMma(f[3]);
      b.w = split.big, s.w = split.small;
      *reinterpret_cast<uint4*>(big + Swizzled(x, k)) = b;
      if (!kPlain) *reinterpret_cast<uint4*>(small + Swizzled(x, k)) = s;
    }
  }
};

// Shared memory: kStages stages that the consumers read (A as its tensor copies land, B big, B small; K-major and
// swizzled), then kRaw slots of B raw in flight from global memory (none where B's planes come by tensor copies),
// then the output boxes (two per consumer, where A is k-contiguous), then the stages' mbarriers. The budget goes to
// the stages first, as many as leave the raw slots their minimum (up to 6).
template <int BN, bool kAK, bool kBK, bool kBP>
struct Layout {
  static constexpr int kABytes = kBm * kRowBytes, kBBytes = BN * kRowBytes;
  static constexpr int kStageBytes = kABytes + 2 * kBBytes;
  static constexpr int kRawBytes = Operand<BN, kBK>::kRawBytes;
  // The raw copies run kAhead = kRaw − 1 k-tiles ahead of the k-tile the producers split. B of the forward and
  // backward-data products is a weight (in L2): one k-tile ahead does; the weight gradient's B is an activation, at
  // least four ahead.
  static constexpr int kMinRaw = kBP ? 0 : kAK ? 2 : 5;
  static constexpr bool kTensorStores = kAK;
  static constexpr int kOutBytes = kTensorStores ? 2 * 2 * kOutBoxBytes : 0;
  static constexpr int kBudget = kStageBudget - kOutBytes;
  static constexpr int kStages = std::min(6, (kBudget - kMinRaw * kRawBytes) / kStageBytes);
  static constexpr int kRaw = kBP ? 0 : std::min(8, (kBudget - kStages * kStageBytes) / kRawBytes);
  static constexpr int kAhead = kRaw - 1;
  static constexpr uint32_t kOut = kStages * kStageBytes + kRaw * kRawBytes;
  static constexpr uint32_t kBarriers = kOut + kOutBytes;
  static constexpr size_t kShared = kBarriers + 2 * 8 * kStages + 1024;  // + alignment
  static_assert(kStages >= 2 && (kBP || kAhead >= 1) && kABytes % 1024 == 0 && kBBytes % 1024 == 0);
  __host__ __device__ static constexpr uint32_t A(int s) { return s * kStageBytes; }
  __host__ __device__ static constexpr uint32_t BBig(int s) { return A(s) + kABytes; }
  __host__ __device__ static constexpr uint32_t BSmall(int s) { return BBig(s) + kBBytes; }
  __host__ __device__ static constexpr uint32_t RawB(int r) { return kStages * kStageBytes + r * kRawBytes; }
  // Output box buffer b (0, 1) of consumer c.
  __host__ __device__ static constexpr uint32_t Out(int c, int b) { return kOut + (2 * c + b) * kOutBoxBytes; }
  __host__ __device__ static constexpr uint32_t Full(int s) { return kBarriers + 8 * s; }
  __host__ __device__ static constexpr uint32_t Empty(int s) { return kBarriers + 8 * (kStages + s); }
  // Each consumer warpgroup's named barrier for its output boxes.
  __host__ __device__ static constexpr int OutBarrier(int c) { return 2 + c; }
};

struct TileCoordinates {
  int z, m0, n0;
};
__device__ __forceinline__ TileCoordinates Coordinates(int tile, int tiles_m, int tiles_n, int bn) {
  const int z = tile / (tiles_m * tiles_n), r = tile % (tiles_m * tiles_n);
  return {z, r / tiles_n * kBm, r % tiles_n * bn};
}
__device__ __forceinline__ int KLength(const GemmParams& p, int z) {
  return p.k_split > 0 ? min(p.k_split, p.k - z * p.k_split) : p.k;
}

// kAK: A is [m, k] (k contiguous), else [k, m]. kBK: B is [n, k] (k contiguous), else [k, n]. kBP: B's big and small
// parts come split already, [n, k] (b_maps: their tensor maps, (k, n, batch)), by tensor copies. a_map: A's tensor map
// for its tensor copies ((k, m, batch) where A is k-contiguous, else (m, k)). Where A is k-contiguous, c_map is C's
// (n, m, batch) for the tensor stores of `store`. kPlain: one product of the TF32 big parts (operands rounded to
// TF32; the `tf32` precision) instead of three, and no small parts stored or copied.
template <int BN, bool kAK, bool kBK, bool kBP, bool kPlain>
__global__ void __launch_bounds__(kThreads, 1)
    GemmTf32x3Kernel(GemmParams p, const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap c_map,
                     const __grid_constant__ CUtensorMap b_big_map, const __grid_constant__ CUtensorMap b_small_map,
                     StoreMode store, int tiles_m, int tiles_n, int tiles) {
  static_assert(!kBP || (kAK && kBK));
  using L = Layout<BN, kAK, kBK, kBP>;
  constexpr uint32_t kStageBBytes = (kPlain ? 1 : 2) * L::kBBytes;  // what a stage's B parts bring
  extern __shared__ unsigned char smem_unaligned[];
  const uint32_t unaligned = SharedAddress(smem_unaligned);
  const uint32_t base = (unaligned + 1023) & ~1023u;  // the swizzle pattern repeats every 1,024 bytes
  unsigned char* smem = smem_unaligned + (base - unaligned);
  const int group = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      // Every producer thread, and A's expected bytes (only the latter, and B's, where B comes split).
      MbarrierInit(base + L::Full(s), kBP ? 1 : kProducerThreads + 1);
      MbarrierInit(base + L::Empty(s), kThreads - kProducerThreads);
    }
  }
  __syncthreads();
  // Launched in the forward's chain (engine/cuda_model.cc), the kernel ahead wrote A (or C, which beta 1 reads). B's
  // parts, split before the chain, no kernel of it writes: where they come split, the thread that copies them sends
  // the first stages' B out before it waits (FULL expects the stage's A too), with the descriptors' prefetches.
  int preloaded = 0;
  if constexpr (kBP) {
    if (threadIdx.x == 0) {
      PrefetchTensorMap(a_map);
      PrefetchTensorMap(b_big_map);
      if (!kPlain) PrefetchTensorMap(b_small_map);
      if (store != StoreMode::kRegisters) PrefetchTensorMap(c_map);
      int tile = blockIdx.x, k0 = 0;
      TileCoordinates tc = Coordinates(tile, tiles_m, tiles_n, BN);
      int k_len = KLength(p, tc.z);
      for (; preloaded < L::kStages && tile < tiles; ++preloaded) {
        const int s = preloaded, zb = p.stride_b != 0 ? tc.z : 0;
        MbarrierArriveExpect(base + L::Full(s), L::kABytes + kStageBBytes);
        TensorCopy(base + L::BBig(s), b_big_map, k0, tc.n0, zb, base + L::Full(s));
        if (!kPlain) TensorCopy(base + L::BSmall(s), b_small_map, k0, tc.n0, zb, base + L::Full(s));
        k0 += kBk;
        if (k0 >= k_len) {
          k0 = 0;
          tile += gridDim.x;
          tc = Coordinates(tile, tiles_m, tiles_n, BN);
          k_len = KLength(p, tc.z);
        }
      }
    }
  }
  WaitForPriorKernels();
  LetNextKernelLaunch();

  if (threadIdx.x < kProducerThreads) {
    const int tid = threadIdx.x;
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegisters));
    // k-tiles in the order the consumers take them: each of this block's tiles, each tile's k-tiles. A tile's
    // coordinates are worked out once (integer divisions), not per k-tile.
    struct Walk {
      int tile, k0, k_len;
      TileCoordinates tc;
    };
    auto start = [&](Walk& w, int tile) {
      w.tile = tile;
      w.k0 = 0;
      w.tc = Coordinates(tile, tiles_m, tiles_n, BN);
      w.k_len = KLength(p, w.tc.z);
    };
    auto next = [&](Walk& w) {
      w.k0 += kBk;
      if (w.k0 >= w.k_len) start(w, w.tile + gridDim.x);
    };
    if constexpr (kBP) {
      // One thread issues every tensor copy; the rest have nothing to do.
      if (tid != 0) return;
      Walk w;
      start(w, blockIdx.x);
      for (int it = 0; w.tile < tiles; next(w), ++it) {
        const int s = it % L::kStages;
        if (it >= L::kStages) MbarrierWait(base + L::Empty(s), (it / L::kStages + 1) % 2);
        const TileCoordinates& tc = w.tc;
        // The first `preloaded` stages' B went out before the wait, their FULL's bytes expected then.
        if (it >= preloaded) MbarrierArriveExpect(base + L::Full(s), L::kABytes + kStageBBytes);
        TensorCopy(base + L::A(s), a_map, w.k0, tc.m0, p.stride_a != 0 ? tc.z : 0, base + L::Full(s));
        if (it >= preloaded) {
          const int zb = p.stride_b != 0 ? tc.z : 0;
          TensorCopy(base + L::BBig(s), b_big_map, w.k0, tc.n0, zb, base + L::Full(s));
          if (!kPlain) TensorCopy(base + L::BSmall(s), b_small_map, w.k0, tc.n0, zb, base + L::Full(s));
        }
      }
    } else {
      Walk fetching, storing;
      start(fetching, blockIdx.x);
      start(storing, blockIdx.x);
      auto fetch = [&](int r) {
        if (fetching.tile < tiles) {
          const TileCoordinates& tc = fetching.tc;
          Operand<BN, kBK>::Fetch(base + L::RawB(r), p.b + tc.z * p.stride_b, p.ldb, tc.n0, p.n, fetching.k0,
                                  fetching.k_len, tid);
          next(fetching);
        }
        CopyAsyncCommit();  // empty groups past the end keep the count of groups in flight uniform
      };
#pragma unroll
      for (int r = 0; r < L::kAhead; ++r) fetch(r);
      for (int it = 0; storing.tile < tiles; next(storing), ++it) {
        const int r = it % L::kRaw, s = it % L::kStages;
        // This thread's copies of k-tile it have landed (kAhead − 1 groups are younger); with the barrier, every
        // producer thread's have, and every producer is done splitting k-tile it − 1.
        CopyAsyncWait<L::kAhead - 1>();
        // Where B is k-contiguous, every producer thread splits exactly the pieces it copied, so its own cp.async
        // wait is all the ordering the raw slots need; otherwise the producers read each other's copies.
        if (!kBK) BarSync<kProducerThreads>(kProducerBarrier);
        // Into the slot of k-tile it − 1, before waiting for the consumers: off the path from their EMPTY to FULL.
        fetch((it + L::kAhead) % L::kRaw);
        // Stage s last held k-tile it − kStages: wait until every consumer thread is done with it.
        if (it >= L::kStages) MbarrierWait(base + L::Empty(s), (it / L::kStages + 1) % 2);
        if (tid == 0) {
          // A straight into the stage (zeros past m and k); FULL(s) waits for its bytes too.
          const TileCoordinates& tc = storing.tc;
          MbarrierArriveExpect(base + L::Full(s), L::kABytes);
          if (kAK) {
            // A batch that shares A (stride 0) has one layer in the map.
            TensorCopy(base + L::A(s), a_map, storing.k0, tc.m0, p.stride_a != 0 ? tc.z : 0, base + L::Full(s));
          } else {
            // [k][m]: boxes of 32 rows of m; the z-th row slice starts at row z·k_split of the one-layer map.
            for (int b = 0; b < kBm / kMBox; ++b) {
              TensorCopy(base + L::A(s) + b * kMBoxBytes, a_map, tc.m0 + b * kMBox, tc.z * p.k_split + storing.k0, 0,
                         base + L::Full(s));
            }
          }
        }
        Operand<BN, kBK>::template Store<kPlain>(smem + L::RawB(r), smem + L::BBig(s), smem + L::BSmall(s), tid);
        // The stores are generic-proxy writes that wgmma reads through the async proxy.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        MbarrierArrive(base + L::Full(s));
      }
      // No copy may still be landing when the block exits.
      CopyAsyncWait<0>();
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegisters));
  const int consumer = group - kProducerThreads / 128, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  constexpr int kRegs = BN / 2, kSteps = kBk / 8;
  float part[kRegs];
#pragma unroll
  for (int i = 0; i < kRegs; ++i) part[i] = 0.f;
  // Plain TF32 with A k-contiguous: A straight from its stage (the consumer's 64 rows, K-major and swizzled as B),
  // one wgmma a k-step, and the tile's k-tiles chained in the tensor cores' running sum, so that k-tile j + 1's
  // wgmma issue while k-tile j's still run; a stage goes back once the k-tile after it has issued (`wait_group 1`).
  // No A passes through registers, whose loads between wgmma would serialize them (ptxas C7513). The tensor cores
  // take A's float32 bits as they are, where the register path rounds them to TF32 first: the GEMM test's worst
  // plain-TF32 error went 2.6e-4 -> 4.1e-4 (its bar 2e-3), and small's tf32 step 813 -> 790 µs (H200). Other
  // products keep the loop below.
  auto plain_k_tile = [&](int j, int it_j, float(&d)[kRegs]) {
    const int s = it_j % L::kStages;
    MbarrierWait(base + L::Full(s), it_j / L::kStages % 2);
    const uint64_t a = Descriptor(base + L::A(s) + consumer * 64 * kRowBytes), b = Descriptor(base + L::BBig(s));
#pragma unroll
    for (int i = 0; i < kRegs; ++i) FenceOperand(d[i]);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      const uint64_t step = ks * 8 * 4 >> 4;  // 32 bytes along k inside the swizzle row, in 16-byte units
      Wgmma<BN>::Run(d, a + step, b + step, j > 0 || ks > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    if (j > 0) MbarrierArrive(base + L::Empty((it_j - 1) % L::kStages));
  };
  auto plain_tile_products = [&](int k_len, int& it_tile, float(&d)[kRegs]) {
    for (int j = 0; j < CeilDiv(k_len, kBk); ++j) plain_k_tile(j, it_tile++, d);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int i = 0; i < kRegs; ++i) FenceOperand(d[i]);
    MbarrierArrive(base + L::Empty((it_tile - 1) % L::kStages));
  };
  int it = 0, boxes = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const TileCoordinates tc = Coordinates(tile, tiles_m, tiles_n, BN);
    const int k_len = KLength(p, tc.z);
    float acc[kRegs];
#pragma unroll
    for (int i = 0; i < kRegs; ++i) acc[i] = 0.f;
    if constexpr (kPlain && kAK) {
      plain_tile_products(k_len, it, acc);
    } else {
      for (int k0 = 0; k0 < k_len; k0 += kBk, ++it) {
        const int s = it % L::kStages;
        MbarrierWait(base + L::Full(s), it / L::kStages % 2);
        // This warp's A fragments for the k-tile's four k-steps, split here rather than by the producer: no A split
        // or store for the producer, and wgmma reads no A from shared memory. Lanes of one load hit 32 distinct banks
        // where A is k-contiguous (the swizzle puts rows g = 0..7 of one 16-byte chunk in different chunks), at most
        // two lanes share one where it is m-contiguous. The small part stays float32 for the tensor cores to truncate
        // (SplitTf32ForMma, as for B): this split sits between a stage's arrival and its first wgmma.
        const unsigned char* a_tile = smem + L::A(s);
        uint32_t a_big[kSteps][4], a_small[kSteps][4];
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = consumer * 64 + warp * 16 + g + 8 * (i % 2), k = ks * 8 + t + 4 * (i / 2);
            // An m-contiguous A's box holds 32 rows of m as its k rows' columns.
            const uint32_t at = kAK ? Swizzled(row, k) : row / kMBox * kMBoxBytes + Swizzled(k, row % kMBox);
            const Tf32Split split = SplitTf32ForMma(*reinterpret_cast<const float*>(a_tile + at));
            a_big[ks][i] = split.big;
            a_small[ks][i] = split.small;
          }
        }
        const uint64_t b_big = Descriptor(base + L::BBig(s)), b_small = Descriptor(base + L::BSmall(s));
#pragma unroll
        for (int i = 0; i < kRegs; ++i) FenceOperand(part[i]);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        // The tensor cores round their running sum toward zero at every step, a bias that grows with the length of
        // the sum: each k-tile is summed from zero (scale_d = 0 on its first wgmma) and the k-tiles are added in
        // float32, rounded to nearest. The correction terms go in first, while the sum is still small.
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
          const uint64_t step = ks * 8 * 4 >> 4;  // 32 bytes along k inside the swizzle row, in 16-byte units
          if (kPlain) {
            Wgmma<BN>::Run(part, a_big[ks], b_big + step, ks);
          } else {
            Wgmma<BN>::Run(part, a_small[ks], b_big + step, ks);
            Wgmma<BN>::Run(part, a_big[ks], b_small + step, 1);
            Wgmma<BN>::Run(part, a_big[ks], b_big + step, 1);
          }
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
        for (int i = 0; i < kRegs; ++i) FenceOperand(part[i]);
        // The wgmma read the A fragments until here: keep their registers from being reused before.
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            FenceRegister(a_big[ks][i]);
            if (!kPlain) FenceRegister(a_small[ks][i]);
          }
        }
        MbarrierArrive(base + L::Empty(s));
#pragma unroll
        for (int i = 0; i < kRegs; ++i) acc[i] += part[i];
      }
    }

    const float* bias = p.bias != nullptr ? p.bias + tc.z * p.stride_bias : nullptr;
    if (L::kTensorStores && store != StoreMode::kRegisters) {
      // Box by box of 32 columns: this warpgroup writes its rows into a free buffer (swizzled, so that a warp's
      // float2 stores hit every bank once), and one thread hands it to a tensor store.
      const bool leader = threadIdx.x % 128 == 0;
#pragma unroll
      for (int q = 0; q < BN / kOutCols; ++q, ++boxes) {
        const uint32_t buffer = base + L::Out(consumer, boxes % 2);
        // The store issued from this buffer two boxes ago has read it out.
        if (leader) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        BarSync<128>(L::OutBarrier(consumer));
#pragma unroll
        for (int jj = 0; jj < kOutCols / 8; ++jj) {
          const int j = q * (kOutCols / 8) + jj, col = tc.n0 + j * 8 + 2 * t;
          float b0 = -0.f, b1 = -0.f;  // x + −0 is x, bit for bit (+0 would turn −0 into +0)
          if (bias != nullptr) {
            if (col < p.n) b0 = bias[col];
            if (col + 1 < p.n) b1 = bias[col + 1];
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t at = buffer + Swizzled(warp * 16 + g + 8 * h, jj * 8 + 2 * t);
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at), "f"(acc[4 * j + 2 * h] + b0),
                         "f"(acc[4 * j + 2 * h + 1] + b1)
                         : "memory");
          }
        }
        // Generic-proxy writes that the tensor store reads through the async proxy; rows and columns past the
        // output are not stored.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        BarSync<128>(L::OutBarrier(consumer));
        if (leader) TensorStore(store, c_map, buffer, tc.n0 + q * kOutCols, tc.m0 + consumer * kOutRows, tc.z);
      }
      continue;
    }
    // Each lane holds column pairs (2t, 2t + 1): stored as one float2 where the output's rows are 8-byte aligned.
    float* c = p.c + tc.z * p.stride_c;
    const bool pairs = p.ldc % 2 == 0 && reinterpret_cast<uintptr_t>(c) % 8 == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = tc.m0 + consumer * 64 + warp * 16 + g + 8 * h;
      if (row >= p.m) continue;
      float* c_row = c + static_cast<int64_t>(row) * p.ldc;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = tc.n0 + j * 8 + 2 * t;
        float v[2] = {acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]};
        if (pairs && col + 1 < p.n) {
          if (bias != nullptr) {
            v[0] += bias[col];
            v[1] += bias[col + 1];
          }
          if (p.beta != 0.f) {
            const float2 old = *reinterpret_cast<const float2*>(c_row + col);
            v[0] += p.beta * old.x;
            v[1] += p.beta * old.y;
          }
          *reinterpret_cast<float2*>(c_row + col) = make_float2(v[0], v[1]);
          continue;
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (col + e >= p.n) continue;
          if (bias != nullptr) v[e] += bias[col + e];
          if (p.beta != 0.f) v[e] += p.beta * c_row[col + e];
          c_row[col + e] = v[e];
        }
      }
    }
  }
  // The tensor stores have completed before the block exits.
  if (L::kTensorStores && threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// The tensor map of a row-major [layers][rows][cols] float32 tensor (leading dimension ld, layers `stride` apart; in
// floats) in boxes of box_cols × box_rows (box_cols · 4 = 128 bytes) with the 128-byte swizzle of Swizzled(): a
// host-side encoding, no device call, so a launch being captured into a graph may build it.
cudaError_t TensorMap(const float* a, int cols, int rows, int64_t ld, int layers, int64_t stride, int box_cols,
                      int box_rows, CUtensorMap* map) {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return Encode{nullptr};
    }
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(layers)};
  // A single layer's stride is never used; any valid one does.
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(ld) * 4,
                                 static_cast<cuuint64_t>(layers > 1 ? stride : ld * rows) * 4};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1},
                   element_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<float*>(a), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// kBP: p.b is B's big part, b_small its small part (unread where kPlain), both as B would be. `programmatic`: as the
// programmatic dependent of the kernel ahead on the stream (kernels/common.cuh).
template <int BN, bool kAK, bool kBK, bool kBP, bool kPlain>
cudaError_t Launch(const GemmParams& p, int count, cudaStream_t stream, const float* b_small, bool programmatic) {
  // An empty sum would have the producer hand over k-tiles that the consumers never take.
  if (p.k <= 0) return cudaErrorInvalidValue;
  using L = Layout<BN, kAK, kBK, kBP>;
  const auto kernel = GemmTf32x3Kernel<BN, kAK, kBK, kBP, kPlain>;
  CUtensorMap a_map{}, c_map{}, b_big_map{}, b_small_map{};
  if (kBP) {
    const int layers = p.stride_b != 0 ? count : 1;
    for (auto [b, map] : {std::pair{p.b, &b_big_map}, std::pair{b_small, &b_small_map}}) {
      if (kPlain && map == &b_small_map) break;  // the small parts are not read
      if (const cudaError_t e = TensorMap(b, p.k, p.n, p.ldb, layers, p.stride_b, kBk, BN, map); e != cudaSuccess) {
        return e;
      }
    }
  }
  StoreMode store = StoreMode::kRegisters;
  if (kAK) {
    if (const cudaError_t e =
            TensorMap(p.a, p.k, p.m, p.lda, p.stride_a != 0 ? count : 1, p.stride_a, kBk, kBm, &a_map);
        e != cudaSuccess) {
      return e;
    }
    // Tensor stores take 16-byte aligned rows and layers, and beta 0 or 1; the rest stores from registers.
    if ((p.beta == 0.f || p.beta == 1.f) && reinterpret_cast<uintptr_t>(p.c) % 16 == 0 && p.ldc % 4 == 0 &&
        (count == 1 || (p.stride_c != 0 && p.stride_c % 4 == 0))) {
      if (const cudaError_t e = TensorMap(p.c, p.n, p.m, p.ldc, count, p.stride_c, kOutCols, kOutRows, &c_map);
          e != cudaSuccess) {
        return e;
      }
      store = p.beta == 0.f ? StoreMode::kTensor : StoreMode::kTensorAdd;
    }
  } else {
    // [k][m] over all of k: row slice z starts at row z·k_split.
    if (const cudaError_t e = TensorMap(p.a, p.m, p.k, p.lda, 1, 0, kMBox, kBk, &a_map); e != cudaSuccess) return e;
  }
  // Per launch rather than once: the attribute is per device, and a process may drive several.
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kShared);
      e != cudaSuccess) {
    return e;
  }
  int sms = 0;
  if (const cudaError_t e = MultiprocessorCount(&sms); e != cudaSuccess) return e;
  const int tiles_m = CeilDiv(p.m, kBm), tiles_n = CeilDiv(p.n, BN), tiles = tiles_m * tiles_n * count;
  return LaunchKernel(kernel, std::min(tiles, sms), kThreads, L::kShared, stream, programmatic, p, a_map, c_map,
                      b_big_map, b_small_map, store, tiles_m, tiles_n, tiles);
}

template <bool kAK, bool kBK, bool kBP, bool kPlain>
cudaError_t LaunchTile(GemmTile tile, const GemmParams& p, int count, cudaStream_t stream, const float* b_small,
                       bool programmatic) {
  switch (tile) {
    case GemmTile::k128x128:
      return Launch<128, kAK, kBK, kBP, kPlain>(p, count, stream, b_small, programmatic);
    case GemmTile::k128x64:
      return Launch<64, kAK, kBK, kBP, kPlain>(p, count, stream, b_small, programmatic);
    case GemmTile::kAuto:
      break;
  }
  return cudaErrorInvalidValue;
}

// LaunchTile<kAK, kBK, kBP, plain>.
template <bool kAK, bool kBK, bool kBP = false>
cudaError_t LaunchTerms(bool plain, GemmTile tile, const GemmParams& p, int count, cudaStream_t stream,
                        const float* b_small = nullptr, bool programmatic = false) {
  return plain ? LaunchTile<kAK, kBK, kBP, true>(tile, p, count, stream, b_small, programmatic)
               : LaunchTile<kAK, kBK, kBP, false>(tile, p, count, stream, b_small, programmatic);
}

int TileCols(GemmTile tile) { return tile == GemmTile::k128x128 ? 128 : 64; }

// 128 columns per tile except for outputs up to 64 wide, whose tiles would be half empty.
GemmTile AutoTile(GemmTile tile, int n) {
  if (tile != GemmTile::kAuto) return tile;
  return n <= 64 ? GemmTile::k128x64 : GemmTile::k128x128;
}

// dw[m, n] = Σ_s partials[s][m][n], the slices added in order; four columns per thread (n is a multiple of 4). A
// thread issues the loads of kSliceBatch slices before it adds them: one load at a time kept every thread waiting on
// memory (small's in_proj gradient, 26 slices, took ~16 µs).
constexpr int kSliceBatch = 8;
__global__ void SumSlicesKernel(const float* __restrict__ partials, int slices, int m, int n, float* dw, int lddw) {
  const int quads = n / 4;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= m * quads) return;
  const int row = idx / quads, col = idx % quads * 4;
  const size_t slice = static_cast<size_t>(m) * n;
  const float* src = partials + static_cast<size_t>(row) * n + col;
  float4 sum = *reinterpret_cast<const float4*>(src);
  for (int s0 = 1; s0 < slices; s0 += kSliceBatch) {
    float4 v[kSliceBatch];
#pragma unroll
    for (int j = 0; j < kSliceBatch; ++j) {
      if (s0 + j < slices) v[j] = *reinterpret_cast<const float4*>(src + (s0 + j) * slice);
    }
#pragma unroll
    for (int j = 0; j < kSliceBatch; ++j) {
      if (s0 + j >= slices) break;
      sum.x += v[j].x;
      sum.y += v[j].y;
      sum.z += v[j].z;
      sum.w += v[j].w;
    }
  }
  float* out = dw + static_cast<size_t>(row) * lddw + col;
  out[0] = sum.x;
  out[1] = sum.y;
  out[2] = sum.z;
  out[3] = sum.w;
}

// Tf32x3SplitJob's planes, a 32 × 32 tile of the weight a block: the transposed planes are written from a shared
// tile, so that both writes are coalesced. The split is the producers' (SplitTf32ForMma), so a product from the
// planes has the same bits as one that splits the weight itself.
constexpr int kSplitTile = 32, kSplitRows = 8;
__global__ void SplitWeightsKernel(const Tf32x3SplitJob* __restrict__ jobs) {
  const Tf32x3SplitJob job = jobs[blockIdx.z];
  const int r0 = blockIdx.y * kSplitTile, c0 = blockIdx.x * kSplitTile;
  if (r0 >= job.rows || c0 >= job.cols) return;
  __shared__ uint32_t big[kSplitTile][kSplitTile + 1], small[kSplitTile][kSplitTile + 1];
  for (int i = threadIdx.y; i < kSplitTile; i += kSplitRows) {
    const int r = r0 + i, c = c0 + threadIdx.x;
    if (r < job.rows && c < job.cols) {
      const Tf32Split split = SplitTf32ForMma(job.w[static_cast<int64_t>(r) * job.cols + c]);
      job.big[static_cast<int64_t>(r) * job.cols + c] = __uint_as_float(split.big);
      job.small[static_cast<int64_t>(r) * job.cols + c] = __uint_as_float(split.small);
      big[i][threadIdx.x] = split.big;
      small[i][threadIdx.x] = split.small;
    }
  }
  __syncthreads();
  const int64_t ld_t = job.ld_t > 0 ? job.ld_t : job.rows;
  for (int i = threadIdx.y; i < kSplitTile; i += kSplitRows) {
    const int c = c0 + i, r = r0 + threadIdx.x;
    if (r < job.rows && c < job.cols) {
      job.big_t[static_cast<int64_t>(c) * ld_t + r] = __uint_as_float(big[threadIdx.x][i]);
      job.small_t[static_cast<int64_t>(c) * ld_t + r] = __uint_as_float(small[threadIdx.x][i]);
    }
  }
}

}  // namespace

cudaError_t LaunchGemmTf32x3Forward(int rows, int in, int out, const float* x, int ldx, int64_t stride_x,
                                    const float* w, int ldw, int64_t stride_w, const float* bias, int64_t stride_bias,
                                    float beta, float* y, int ldy, int64_t stride_y, int count, cudaStream_t stream,
                                    GemmTile tile, const Tf32x3Planes* planes, bool programmatic, bool plain_tf32) {
  if (rows <= 0 || out <= 0 || count <= 0) return cudaSuccess;
  GemmParams p{x, ldx, stride_x, w, ldw, stride_w, y, ldy, stride_y, bias, stride_bias, beta, rows, out, in, 0};
  if (planes != nullptr && planes->big != nullptr) {
    // The planes' layout is w's own: a w passed at another stride or wider than the split one has no planes here.
    if (ldw != planes->cols || out > planes->rows || in > planes->cols) return cudaErrorInvalidValue;
    p.b = planes->big;
    return LaunchTerms<true, true, true>(plain_tf32, AutoTile(tile, out), p, count, stream, planes->small,
                                         programmatic);
  }
  return LaunchTerms<true, true>(plain_tf32, AutoTile(tile, out), p, count, stream, nullptr, programmatic);
}

cudaError_t LaunchGemmTf32x3BackwardData(int rows, int in, int out, const float* dy, int lddy, const float* w, int ldw,
                                         float beta, float* dx, int lddx, cudaStream_t stream, GemmTile tile,
                                         const Tf32x3Planes* planes, bool plain_tf32) {
  if (rows <= 0 || in <= 0) return cudaSuccess;
  if (planes != nullptr && planes->big_t != nullptr) {
    const int ld_t = planes->TransposedLd();
    if (ldw != planes->cols || out > planes->rows || in > planes->cols || ld_t < planes->rows || ld_t % 4 != 0) {
      return cudaErrorInvalidValue;
    }
    // dy · w is the forward product of dy under wᵀ, whose parts are [cols, rows]: its first `in` rows, `out` columns.
    const GemmParams p{dy, lddy, 0, planes->big_t, ld_t, 0, dx, lddx, 0, nullptr, 0, beta, rows, in, out, 0};
    return LaunchTerms<true, true, true>(plain_tf32, AutoTile(tile, in), p, 1, stream, planes->small_t);
  }
  const GemmParams p{dy, lddy, 0, w, ldw, 0, dx, lddx, 0, nullptr, 0, beta, rows, in, out, 0};
  return LaunchTerms<true, false>(plain_tf32, AutoTile(tile, in), p, 1, stream);
}

cudaError_t LaunchTf32x3SplitWeights(const Tf32x3SplitJob* jobs, int count, int max_rows, int max_cols,
                                     cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const dim3 grid(CeilDiv(max_cols, kSplitTile), CeilDiv(max_rows, kSplitTile), count);
  SplitWeightsKernel<<<grid, dim3(kSplitTile, kSplitRows), 0, stream>>>(jobs);
  return cudaGetLastError();
}

cudaError_t LaunchGemmTf32x3BackwardWeight(int rows, int in, int out, const float* dy, int lddy, const float* x,
                                           int ldx, float* dw, int lddw, float* workspace, size_t workspace_bytes,
                                           cudaStream_t stream, GemmTile tile, int splits, bool shares_device) {
  if (in <= 0 || out <= 0) return cudaSuccess;
  // Where 128-wide tiles would leave at most two per slice, 64-wide ones measured faster (H200, 16,384 rows, µs:
  // CfC backbone 128×128 18.5 against 22.1, out_proj 256→128 23.0 against 23.9, CfC heads 23.0 against 23.8; small's
  // in_proj, five tiles, 43.5 against 36.4).
  if (tile == GemmTile::kAuto && CeilDiv(out, kBm) * CeilDiv(in, 128) <= 2) tile = GemmTile::k128x64;
  tile = AutoTile(tile, in);
  const int tiles = CeilDiv(out, kBm) * CeilDiv(in, TileCols(tile));
  const int ktiles = CeilDiv(std::max(rows, 1), kBk);
  const size_t slice_floats = static_cast<size_t>(out) * in;
  const int most = static_cast<int>(std::min<size_t>(workspace_bytes / (slice_floats * sizeof(float)), ktiles));
  if (splits <= 0) {
    int sms = 0;
    if (const cudaError_t e = MultiprocessorCount(&sms); e != cudaSuccess) return e;
    // The blocks walk tiles × slices items in waves of `for_sms`: the slice count that minimizes the waves times each
    // item's k-tiles (a wave part-full costs a full one: 4 slices of large's in_proj gradient, 288 items, took 3
    // waves where 7 slices' 504 take 4 of 58% the length), the fewest slices among equals since every
    // slice's partial is written and read back once more.
    auto plan = [&](int for_sms) {
      int planned = 1;
      int64_t best = -1;
      for (int s = 1; s <= std::min(most, std::max(ktiles / kMinSliceTiles, 1)); ++s) {
        const int slice_tiles = CeilDiv(ktiles, s), slices = CeilDiv(ktiles, slice_tiles);
        const int64_t cost = int64_t{CeilDiv(tiles * slices, for_sms)} * (slice_tiles + kItemOverheadTiles);
        if (best < 0 || cost < best) best = cost, planned = slices;
      }
      return planned;
    };
    splits = plan(sms);
    // Beside other work, a product that the device would run in one wave gains little from all of it; half the
    // slices write and sum half the partials (H200, small 3xtf32, the weight gradients beside the data gradients'
    // chain, alternating: 1,063.2–1,065.6 against 1,068.5–1,071.6 µs a step copying its batch, 1,010.3–1,012.6
    // against 1,014.7–1,017.9 prefetching; every product planned for half the device instead, large lost 0.4%).
    // Longer products keep the device's plan (large's in_proj gradient).
    if (shares_device && tiles * splits <= sms) splits = plan(std::max(sms / 2, 1));
  }
  splits = std::min(splits, most);
  if (splits <= 1) {
    const GemmParams p{dy, lddy, 0, x, ldx, 0, dw, lddw, 0, nullptr, 0, 0.f, out, in, rows, 0};
    return LaunchTile<false, false, false, false>(tile, p, 1, stream, nullptr, false);
  }
  // Whole k-tiles per slice; the last slice takes what is left, so the count may come out lower.
  const int k_split = CeilDiv(ktiles, splits) * kBk;
  splits = CeilDiv(rows, k_split);
  const GemmParams p{dy,      lddy, static_cast<int64_t>(k_split) * lddy,
                     x,       ldx,  static_cast<int64_t>(k_split) * ldx,
                     workspace, in, static_cast<int64_t>(slice_floats),
                     nullptr, 0,    0.f,
                     out,     in,   rows,
                     k_split};
  if (const cudaError_t e = LaunchTile<false, false, false, false>(tile, p, splits, stream, nullptr, false);
      e != cudaSuccess) {
    return e;
  }
  constexpr int kSumThreads = 128;  // small's in_proj gradient: 145 blocks, more than one per SM
  const int quads = out * (in / 4);
  SumSlicesKernel<<<CeilDiv(quads, kSumThreads), kSumThreads, 0, stream>>>(workspace, splits, out, in, dw, lddw);
  return cudaGetLastError();
}

}  // namespace perception::kernels
