// GEMMs on the CPU's matrix units through oneDNN's brgemm microkernel (torch's
// at::native::cpublas::brgemm, JIT-compiled for the CPU's ISA): a weight packed once into
// VNNI blocks, the tiles spread over threads, and an epilogue run on each tile while it is in
// cache. Shared by the bfloat16 GEMM (bf16_ops.cpp) and the int8 one (w8a8_ops.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// w [N, K] (K % kPack == 0) -> dst [N * K]: blocks of block_n output channels, each
// [K / kPack, nb, kPack] (kPack consecutive k of one channel side by side: the layout the tile
// instructions read; kPack = 2 for bfloat16, 4 for int8). The last block may be narrower.
template <int kPack, typename T>
void vnni_pack_into(const T* src, int64_t n, int64_t k, int64_t block_n, T* dst) {
  at::parallel_for(0, (n + block_n - 1) / block_n, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * block_n, nb = std::min(block_n, n - n0);
      T* block = dst + n0 * k;
      for (int64_t kp = 0; kp < k / kPack; ++kp)
        for (int64_t j = 0; j < nb; ++j)
          for (int64_t t = 0; t < kPack; ++t)
            block[(kp * nb + j) * kPack + t] = src[(n0 + j) * k + kPack * kp + t];
    }
  });
}

// out = epilogue(a [M, K] @ w.T) from w packed by vnni_pack_into: tasks of block_m rows x one
// weight block go to the threads; each computes its tile into a [block_m, block_n] Acc buffer
// and calls epilogue(tile, m0, mb, n0, nb) (the tile's rows nb apart).
// NOTE: the order of the tiles: the weight blocks go in chunks of about chunk_bytes (a core's
// L2 holds one), and within a chunk row tile by row tile, each row tile against every block of
// the chunk. Contiguous ranges of tasks go to the threads, so a prompt's threads each take half
// of the row tiles and keep the chunk in their L2, reading the activations once per chunk; a
// decode batch (one row tile) splits the blocks between them. Block by block (every row tile
// against one block, then the next) read the activations again for each block of 64 columns:
// at 4,064 rows SmolLM2's four int8 GEMMs took 19.4 ms of CPU time that way, 12.8 ms this way
// (gate/up 14.3 against 8.8; Intel Xeon family 6 model 167, 2026-11-26).
template <typename Acc, typename T, typename Epilogue>
void vnni_tiles(const T* a, int64_t m, int64_t k, const T* packed, int64_t n, int64_t block_m,
                int64_t block_n, int64_t chunk_bytes, const Epilogue& epilogue) {
  const int64_t m_blocks = (m + block_m - 1) / block_m;
  const int64_t n_blocks = (n + block_n - 1) / block_n;
  const int64_t block_bytes = k * block_n * static_cast<int64_t>(sizeof(T));
  const int64_t chunk = std::max<int64_t>(1, chunk_bytes / block_bytes);  // blocks per chunk
  at::parallel_for(0, m_blocks * n_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<Acc> tile(block_m * block_n);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c = t / (m_blocks * chunk);  // every chunk before the last is full
      const int64_t r = t - c * m_blocks * chunk;
      const int64_t width = std::min(chunk, n_blocks - c * chunk);
      const int64_t m0 = (r / width) * block_m, n0 = (c * chunk + r % width) * block_n;
      const int64_t nb = std::min(block_n, n - n0), mb = std::min(block_m, m - m0);
      at::native::cpublas::brgemm(mb, nb, k, k, nb, nb, false, a + m0 * k, packed + n0 * k,
                                  tile.data(), true);
      epilogue(tile.data(), m0, mb, n0, nb);
    }
    at::native::cpublas::brgemm_release();
  });
}

}  // namespace
