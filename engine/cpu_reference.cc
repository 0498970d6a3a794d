// CPU reference of PerceptionNet v1: sequence forward, masked BCE, hand-written backward and the step path.
#include "engine/cpu_reference.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "engine/loss.h"

namespace perception {
namespace {

template <typename T>
T Sigmoid(T v) {
  if (v >= 0) return T(1) / (T(1) + std::exp(-v));
  const T e = std::exp(v);
  return e / (T(1) + e);
}
template <typename T>
T Softplus(T v) {
  return v > T(20) ? v : std::log1p(std::exp(v));
}
template <typename T>
T SoftplusGrad(T v) {
  return v > T(20) ? T(1) : Sigmoid(v);
}
template <typename T>
T Silu(T v) {
  return v * Sigmoid(v);
}
template <typename T>
T SiluGrad(T v) {
  const T s = Sigmoid(v);
  return s * (T(1) + v * (T(1) - s));
}
constexpr double kLecunScale = 1.7159, kLecunSlope = 0.666;
template <typename T>
T LecunTanh(T v) {
  return T(kLecunScale) * std::tanh(T(kLecunSlope) * v);
}
template <typename T>
T LecunTanhGrad(T v) {
  const T th = std::tanh(T(kLecunSlope) * v);
  return T(kLecunScale * kLecunSlope) * (T(1) - th * th);
}
template <typename T>
T Elu(T v) {
  return v > 0 ? v : std::expm1(v);
}
template <typename T>
T EluGrad(T v) {
  return v > 0 ? T(1) : std::exp(v);
}
constexpr double kNormEps = 1e-5;

// y[out] = W[out,in]·x (+ b).
template <typename T>
void Affine(const T* w, const T* b, const T* x, int out, int in, T* y) {
  for (int o = 0; o < out; ++o) {
    const T* row = w + static_cast<size_t>(o) * in;
    T acc = b ? b[o] : T(0);
    for (int i = 0; i < in; ++i) acc += row[i] * x[i];
    y[o] = acc;
  }
}

// Backward of Affine: dW += dy⊗x, db += dy, dx (+)= Wᵀ·dy (dx may be null).
template <typename T>
void AffineBackward(const T* w, const T* x, const T* dy, int out, int in, T* dw, T* db, T* dx) {
  for (int o = 0; o < out; ++o) {
    const T g = dy[o];
    if (db) db[o] += g;
    T* drow = dw + static_cast<size_t>(o) * in;
    for (int i = 0; i < in; ++i) drow[i] += g * x[i];
  }
  if (!dx) return;
  for (int o = 0; o < out; ++o) {
    const T g = dy[o];
    const T* row = w + static_cast<size_t>(o) * in;
    for (int i = 0; i < in; ++i) dx[i] += row[i] * g;
  }
}

// rmsnorm(v, w) = v / sqrt(mean(v²) + eps) ⊙ w; returns 1/sqrt(mean(v²) + eps).
template <typename T>
T RmsNorm(const T* v, const T* w, int n, T* y) {
  T ss = 0;
  for (int i = 0; i < n; ++i) ss += v[i] * v[i];
  const T rstd = T(1) / std::sqrt(ss / T(n) + T(kNormEps));
  for (int i = 0; i < n; ++i) y[i] = v[i] * rstd * w[i];
  return rstd;
}

// dv += rmsnorm backward; dw += dy ⊙ v ⊙ rstd.
template <typename T>
void RmsNormBackward(const T* v, const T* w, T rstd, const T* dy, int n, T* dw, T* dv) {
  T dot = 0;
  for (int i = 0; i < n; ++i) {
    dw[i] += dy[i] * v[i] * rstd;
    dot += dy[i] * w[i] * v[i];
  }
  const T coef = rstd * rstd * rstd * dot / T(n);
  for (int i = 0; i < n; ++i) dv[i] += rstd * dy[i] * w[i] - v[i] * coef;
}

// Runs fn(index, worker) for index in [0, count) on up to `threads` workers, each with a fixed slice of indices.
template <typename Fn>
void ParallelFor(int count, int threads, Fn fn) {
  const int workers = std::max(1, std::min(threads, count));
  if (workers == 1) {
    for (int i = 0; i < count; ++i) fn(i, 0);
    return;
  }
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] {
      for (int i = w; i < count; i += workers) fn(i, w);
    });
  }
  for (auto& t : pool) t.join();
}

// Typed pointers to every tensor of the flat buffer (parameters or their gradients).
template <typename P>
struct Tensors {
  Tensors(const ParamLayout& layout, P* base) : layout_(layout), base_(base) {}
  P* operator[](int index) const { return base_ + layout_.tensor(index).offset; }
  const ParamLayout& layout_;
  P* base_;
};

// Activations of one sequence, kept for the backward pass.
template <typename T>
struct LayerActivations {
  std::vector<T> h_in, rstd, r, zxbcdt, conv_hist, conv_pre, xbc, dt_pre, dt, decay, states, y, q,
      rstd_gate, yn;
};

template <typename T>
struct Workspace {
  Workspace(const ModelConfig& c, int window, bool keep_states) : T_(window), keep_states(keep_states) {
    const int D = c.d_model, E = c.d_inner(), Hh = c.n_heads(), cd = c.conv_dim(), W = c.d_conv;
    const int C = c.cfc_units, K = c.cfc_backbone, G = c.grn_hidden, DC = c.head_input();
    const size_t t = window;
    xn.resize(t * c.n_features);
    layers.resize(c.n_layers);
    const size_t state_rows = keep_states ? t + 1 : 2;
    for (auto& a : layers) {
      a.h_in.resize(t * D);
      a.rstd.resize(t);
      a.r.resize(t * D);
      a.zxbcdt.resize(t * c.in_proj_dim());
      a.conv_hist.resize((t + W - 1) * cd);
      a.conv_pre.resize(t * cd);
      a.xbc.resize(t * cd);
      a.dt_pre.resize(t * Hh);
      a.dt.resize(t * Hh);
      a.decay.resize(t * Hh);
      a.states.resize(state_rows * c.ssm_state_size());
      a.y.resize(t * E);
      a.q.resize(t * E);
      a.rstd_gate.resize(t);
      a.yn.resize(t * E);
    }
    h.resize(t * D);
    rstd_f.resize(t);
    s.resize(t * D);
    c_hist.resize((t + 1) * C);
    zc.resize(t * DC);
    bb_pre.resize(t * K);
    bb.resize(t * K);
    f1.resize(t * C);
    f2.resize(t * C);
    tau.resize(t * C);
    a.resize(t * DC);
    pre2.resize(t * G);
    e2.resize(t * G);
    e1.resize(t * G);
    gate_pre.resize(t * G);
    value.resize(t * G);
    ln_rstd.resize(t);
    nhat.resize(t * G);
    g.resize(t * G);
  }
  T* StateRow(LayerActivations<T>& a, int row, size_t state_size) {
    const int r = keep_states ? row : row & 1;
    return a.states.data() + static_cast<size_t>(r) * state_size;
  }

  int T_;
  bool keep_states;
  std::vector<T> xn;
  std::vector<LayerActivations<T>> layers;
  std::vector<T> h, rstd_f, s, c_hist, zc, bb_pre, bb, f1, f2, tau, a, pre2, e2, e1, gate_pre, value,
      ln_rstd, nhat, g;
};

template <typename T>
class SequenceModel {
 public:
  SequenceModel(const ParamLayout& layout, const T* params)
      : layout_(layout), c_(layout.config()), p_(layout, params) {}

  // Forward over one window: x[T,F], dt[T] → logits[T,H]; `state` (may be null) is read and updated.
  void Forward(const T* x, const T* dt, Workspace<T>& ws, StreamState<T>* state, T* logits);
  // Backward from dlogits[T,H] through the activations in `ws`; accumulates into grads, writes dx[T,F] if non-null.
  void Backward(const T* dt, const T* dlogits, Workspace<T>& ws, T* grads, T* dx);

 private:
  void LayerForward(int l, Workspace<T>& ws, StreamState<T>* state);
  void LayerBackward(int l, Workspace<T>& ws, Tensors<T>& g, std::vector<T>& dh);
  void CfcForward(const T* dt, Workspace<T>& ws, StreamState<T>* state);
  void HeadForward(Workspace<T>& ws, T* logits);

  const ParamLayout& layout_;
  const ModelConfig& c_;
  Tensors<const T> p_;
};

template <typename T>
void SequenceModel<T>::Forward(const T* x, const T* dt, Workspace<T>& ws, StreamState<T>* state, T* logits) {
  const int F = c_.n_features, D = c_.d_model, Tn = ws.T_;
  const T* mean = p_[layout_.norm_mean];
  const T* inv_std = p_[layout_.norm_inv_std];
  for (int t = 0; t < Tn; ++t) {
    for (int f = 0; f < F; ++f) ws.xn[t * F + f] = (x[t * F + f] - mean[f]) * inv_std[f];
    Affine(p_[layout_.embed.weight], p_[layout_.embed.bias], &ws.xn[t * F], D, F, &ws.h[t * D]);
  }
  for (int l = 0; l < c_.n_layers; ++l) LayerForward(l, ws, state);
  for (int t = 0; t < Tn; ++t) {
    ws.rstd_f[t] = RmsNorm(&ws.h[t * D], p_[layout_.norm_f], D, &ws.s[t * D]);
  }
  CfcForward(dt, ws, state);
  HeadForward(ws, logits);
}

template <typename T>
void SequenceModel<T>::LayerForward(int l, Workspace<T>& ws, StreamState<T>* state) {
  const int D = c_.d_model, E = c_.d_inner(), N = c_.d_state, P = c_.headdim, Hh = c_.n_heads();
  const int W = c_.d_conv, cd = c_.conv_dim(), zd = c_.in_proj_dim(), Tn = ws.T_;
  const size_t S = c_.ssm_state_size();
  const LayerTensors& lt = layout_.layers[l];
  LayerActivations<T>& a = ws.layers[l];
  std::copy(ws.h.begin(), ws.h.end(), a.h_in.begin());

  for (int t = 0; t < Tn; ++t) {
    a.rstd[t] = RmsNorm(&ws.h[t * D], p_[lt.norm], D, &a.r[t * D]);
    Affine<T>(p_[lt.in_proj], nullptr, &a.r[t * D], zd, D, &a.zxbcdt[static_cast<size_t>(t) * zd]);
  }
  // Causal conv history: W-1 carried rows, then this window's raw xBC.
  const size_t carried = static_cast<size_t>(W - 1) * cd;
  if (state) {
    std::copy_n(state->conv.begin() + l * carried, carried, a.conv_hist.begin());
  } else {
    std::fill_n(a.conv_hist.begin(), carried, T(0));
  }
  for (int t = 0; t < Tn; ++t) {
    std::copy_n(&a.zxbcdt[static_cast<size_t>(t) * zd + E], cd, &a.conv_hist[(t + W - 1) * static_cast<size_t>(cd)]);
  }
  const T* cw = p_[lt.conv_weight];
  const T* cb = p_[lt.conv_bias];
  for (int t = 0; t < Tn; ++t) {
    for (int ch = 0; ch < cd; ++ch) {
      T acc = cb[ch];
      for (int k = 0; k < W; ++k) acc += cw[ch * W + k] * a.conv_hist[(t + k) * static_cast<size_t>(cd) + ch];
      a.conv_pre[t * cd + ch] = acc;
      a.xbc[t * cd + ch] = Silu(acc);
    }
  }
  const T* dt_bias = p_[lt.dt_bias];
  const T* a_log = p_[lt.a_log];
  for (int t = 0; t < Tn; ++t) {
    for (int hh = 0; hh < Hh; ++hh) {
      const T pre = a.zxbcdt[static_cast<size_t>(t) * zd + E + cd + hh] + dt_bias[hh];
      a.dt_pre[t * Hh + hh] = pre;
      a.dt[t * Hh + hh] = Softplus(pre);
      a.decay[t * Hh + hh] = std::exp(a.dt[t * Hh + hh] * -std::exp(a_log[hh]));
    }
  }
  // SSM scan.
  T* s0 = ws.StateRow(a, 0, S);
  if (state) {
    std::copy_n(state->ssm.begin() + l * S, S, s0);
  } else {
    std::fill_n(s0, S, T(0));
  }
  const T* Dp = p_[lt.d];
  for (int t = 0; t < Tn; ++t) {
    const T* prev = ws.StateRow(a, t, S);
    T* cur = ws.StateRow(a, t + 1, S);
    const T* xs = &a.xbc[t * cd];
    const T* Bm = xs + E;
    const T* Cm = xs + E + N;
    for (int hh = 0; hh < Hh; ++hh) {
      const T decay = a.decay[t * Hh + hh], dth = a.dt[t * Hh + hh];
      for (int p = 0; p < P; ++p) {
        const int e = hh * P + p;
        const T xv = xs[e] * dth;
        const size_t base = static_cast<size_t>(e) * N;
        T acc = 0;
        for (int n = 0; n < N; ++n) {
          cur[base + n] = decay * prev[base + n] + xv * Bm[n];
          acc += Cm[n] * cur[base + n];
        }
        a.y[t * E + e] = acc + Dp[hh] * xs[e];
      }
    }
  }
  // Gated norm, out_proj, residual.
  for (int t = 0; t < Tn; ++t) {
    const T* z = &a.zxbcdt[static_cast<size_t>(t) * zd];
    for (int e = 0; e < E; ++e) a.q[t * E + e] = a.y[t * E + e] * Silu(z[e]);
    a.rstd_gate[t] = RmsNorm(&a.q[t * E], p_[lt.mixer_norm], E, &a.yn[t * E]);
    const T* wo = p_[lt.out_proj];
    for (int d = 0; d < D; ++d) {
      T acc = 0;
      for (int e = 0; e < E; ++e) acc += wo[static_cast<size_t>(d) * E + e] * a.yn[t * E + e];
      ws.h[t * D + d] += acc;
    }
  }
  if (state) {
    std::copy_n(&a.conv_hist[static_cast<size_t>(Tn) * cd], carried, state->conv.begin() + l * carried);
    std::copy_n(ws.StateRow(a, Tn, S), S, state->ssm.begin() + l * S);
  }
}

template <typename T>
void SequenceModel<T>::CfcForward(const T* dt, Workspace<T>& ws, StreamState<T>* state) {
  const int D = c_.d_model, C = c_.cfc_units, K = c_.cfc_backbone, DC = c_.head_input(), Tn = ws.T_;
  if (state) {
    std::copy(state->cfc.begin(), state->cfc.end(), ws.c_hist.begin());
  } else {
    std::fill_n(ws.c_hist.begin(), C, T(0));
  }
  std::vector<T> p1(C), p2(C), ta(C), tb(C);
  for (int t = 0; t < Tn; ++t) {
    T* zc = &ws.zc[t * DC];
    std::copy_n(&ws.s[t * D], D, zc);
    std::copy_n(&ws.c_hist[t * C], C, zc + D);
    Affine(p_[layout_.cfc_backbone.weight], p_[layout_.cfc_backbone.bias], zc, K, DC, &ws.bb_pre[t * K]);
    for (int k = 0; k < K; ++k) ws.bb[t * K + k] = LecunTanh(ws.bb_pre[t * K + k]);
    const T* bb = &ws.bb[t * K];
    Affine(p_[layout_.cfc_ff1.weight], p_[layout_.cfc_ff1.bias], bb, C, K, p1.data());
    Affine(p_[layout_.cfc_ff2.weight], p_[layout_.cfc_ff2.bias], bb, C, K, p2.data());
    Affine(p_[layout_.cfc_time_a.weight], p_[layout_.cfc_time_a.bias], bb, C, K, ta.data());
    Affine(p_[layout_.cfc_time_b.weight], p_[layout_.cfc_time_b.bias], bb, C, K, tb.data());
    for (int u = 0; u < C; ++u) {
      const T f1 = std::tanh(p1[u]), f2 = std::tanh(p2[u]);
      const T tau = Sigmoid(ta[u] * dt[t] + tb[u]);
      ws.f1[t * C + u] = f1;
      ws.f2[t * C + u] = f2;
      ws.tau[t * C + u] = tau;
      ws.c_hist[(t + 1) * C + u] = f1 * (T(1) - tau) + tau * f2;
    }
  }
  if (state) std::copy_n(&ws.c_hist[static_cast<size_t>(Tn) * C], C, state->cfc.begin());
}

template <typename T>
void SequenceModel<T>::HeadForward(Workspace<T>& ws, T* logits) {
  const int D = c_.d_model, C = c_.cfc_units, G = c_.grn_hidden, H = c_.n_horizons, DC = c_.head_input();
  std::vector<T> skip(G);
  for (int t = 0; t < ws.T_; ++t) {
    T* a = &ws.a[t * DC];
    std::copy_n(&ws.s[t * D], D, a);
    std::copy_n(&ws.c_hist[(t + 1) * C], C, a + D);
    T* pre2 = &ws.pre2[t * G];
    Affine(p_[layout_.grn_fc2.weight], p_[layout_.grn_fc2.bias], a, G, DC, pre2);
    for (int i = 0; i < G; ++i) ws.e2[t * G + i] = Elu(pre2[i]);
    Affine(p_[layout_.grn_fc1.weight], p_[layout_.grn_fc1.bias], &ws.e2[t * G], G, G, &ws.e1[t * G]);
    Affine(p_[layout_.grn_gate.weight], p_[layout_.grn_gate.bias], &ws.e1[t * G], G, G, &ws.gate_pre[t * G]);
    Affine(p_[layout_.grn_value.weight], p_[layout_.grn_value.bias], &ws.e1[t * G], G, G, &ws.value[t * G]);
    Affine<T>(p_[layout_.grn_skip], nullptr, a, G, DC, skip.data());
    T mean = 0;
    for (int i = 0; i < G; ++i) {
      skip[i] += Sigmoid(ws.gate_pre[t * G + i]) * ws.value[t * G + i];
      mean += skip[i];
    }
    mean /= T(G);
    T var = 0;
    for (int i = 0; i < G; ++i) var += (skip[i] - mean) * (skip[i] - mean);
    const T rstd = T(1) / std::sqrt(var / T(G) + T(kNormEps));
    ws.ln_rstd[t] = rstd;
    const T* nw = p_[layout_.grn_norm.weight];
    const T* nb = p_[layout_.grn_norm.bias];
    for (int i = 0; i < G; ++i) {
      ws.nhat[t * G + i] = (skip[i] - mean) * rstd;
      ws.g[t * G + i] = ws.nhat[t * G + i] * nw[i] + nb[i];
    }
    Affine(p_[layout_.head_out.weight], p_[layout_.head_out.bias], &ws.g[t * G], H, G, logits + t * H);
  }
}

template <typename T>
void SequenceModel<T>::Backward(const T* dt, const T* dlogits, Workspace<T>& ws, T* grads, T* dx) {
  const int F = c_.n_features, D = c_.d_model, C = c_.cfc_units, K = c_.cfc_backbone, G = c_.grn_hidden;
  const int H = c_.n_horizons, DC = c_.head_input(), Tn = ws.T_;
  Tensors<T> g(layout_, grads);
  std::vector<T> ds(static_cast<size_t>(Tn) * D, T(0)), dc_head(static_cast<size_t>(Tn) * C, T(0));
  std::vector<T> dgv(G), dpre_ln(G), dglu_v(G), dgate(G), de1(G), de2(G), da(DC);

  // GRN head, per event.
  const T* nw = p_[layout_.grn_norm.weight];
  for (int t = 0; t < Tn; ++t) {
    std::fill(dgv.begin(), dgv.end(), T(0));
    AffineBackward(p_[layout_.head_out.weight], &ws.g[t * G], dlogits + t * H, H, G, g[layout_.head_out.weight],
                   g[layout_.head_out.bias], dgv.data());
    T mean_dn = 0, mean_dn_n = 0;
    for (int i = 0; i < G; ++i) {
      g[layout_.grn_norm.weight][i] += dgv[i] * ws.nhat[t * G + i];
      g[layout_.grn_norm.bias][i] += dgv[i];
      const T dn = dgv[i] * nw[i];
      mean_dn += dn;
      mean_dn_n += dn * ws.nhat[t * G + i];
    }
    mean_dn /= T(G);
    mean_dn_n /= T(G);
    for (int i = 0; i < G; ++i) {
      dpre_ln[i] = ws.ln_rstd[t] * (dgv[i] * nw[i] - mean_dn - ws.nhat[t * G + i] * mean_dn_n);
      const T sg = Sigmoid(ws.gate_pre[t * G + i]);
      dglu_v[i] = dpre_ln[i] * sg;
      dgate[i] = dpre_ln[i] * ws.value[t * G + i] * sg * (T(1) - sg);
    }
    const T* a = &ws.a[t * DC];
    std::fill(da.begin(), da.end(), T(0));
    AffineBackward<T>(p_[layout_.grn_skip], a, dpre_ln.data(), G, DC, g[layout_.grn_skip], nullptr, da.data());
    std::fill(de1.begin(), de1.end(), T(0));
    AffineBackward(p_[layout_.grn_value.weight], &ws.e1[t * G], dglu_v.data(), G, G, g[layout_.grn_value.weight],
                   g[layout_.grn_value.bias], de1.data());
    AffineBackward(p_[layout_.grn_gate.weight], &ws.e1[t * G], dgate.data(), G, G, g[layout_.grn_gate.weight],
                   g[layout_.grn_gate.bias], de1.data());
    std::fill(de2.begin(), de2.end(), T(0));
    AffineBackward(p_[layout_.grn_fc1.weight], &ws.e2[t * G], de1.data(), G, G, g[layout_.grn_fc1.weight],
                   g[layout_.grn_fc1.bias], de2.data());
    for (int i = 0; i < G; ++i) de2[i] *= EluGrad(ws.pre2[t * G + i]);
    AffineBackward(p_[layout_.grn_fc2.weight], a, de2.data(), G, DC, g[layout_.grn_fc2.weight],
                   g[layout_.grn_fc2.bias], da.data());
    for (int d = 0; d < D; ++d) ds[t * D + d] += da[d];
    for (int u = 0; u < C; ++u) dc_head[t * C + u] += da[D + u];
  }

  // CfC, backward through time.
  std::vector<T> dc(C, T(0)), dp1(C), dp2(C), dta(C), dtb(C), dbb(K), dzc(DC);
  for (int t = Tn - 1; t >= 0; --t) {
    for (int u = 0; u < C; ++u) {
      const T grad_c = dc[u] + dc_head[t * C + u];
      const T f1 = ws.f1[t * C + u], f2 = ws.f2[t * C + u], tau = ws.tau[t * C + u];
      dp1[u] = grad_c * (T(1) - tau) * (T(1) - f1 * f1);
      dp2[u] = grad_c * tau * (T(1) - f2 * f2);
      const T dpre_tau = grad_c * (f2 - f1) * tau * (T(1) - tau);
      dta[u] = dpre_tau * dt[t];
      dtb[u] = dpre_tau;
    }
    const T* bb = &ws.bb[t * K];
    std::fill(dbb.begin(), dbb.end(), T(0));
    AffineBackward(p_[layout_.cfc_ff1.weight], bb, dp1.data(), C, K, g[layout_.cfc_ff1.weight],
                   g[layout_.cfc_ff1.bias], dbb.data());
    AffineBackward(p_[layout_.cfc_ff2.weight], bb, dp2.data(), C, K, g[layout_.cfc_ff2.weight],
                   g[layout_.cfc_ff2.bias], dbb.data());
    AffineBackward(p_[layout_.cfc_time_a.weight], bb, dta.data(), C, K, g[layout_.cfc_time_a.weight],
                   g[layout_.cfc_time_a.bias], dbb.data());
    AffineBackward(p_[layout_.cfc_time_b.weight], bb, dtb.data(), C, K, g[layout_.cfc_time_b.weight],
                   g[layout_.cfc_time_b.bias], dbb.data());
    for (int k = 0; k < K; ++k) dbb[k] *= LecunTanhGrad(ws.bb_pre[t * K + k]);
    std::fill(dzc.begin(), dzc.end(), T(0));
    AffineBackward(p_[layout_.cfc_backbone.weight], &ws.zc[t * DC], dbb.data(), K, DC,
                   g[layout_.cfc_backbone.weight], g[layout_.cfc_backbone.bias], dzc.data());
    for (int d = 0; d < D; ++d) ds[t * D + d] += dzc[d];
    std::copy_n(dzc.begin() + D, C, dc.begin());
  }

  // Final norm.
  std::vector<T> dh(static_cast<size_t>(Tn) * D, T(0));
  for (int t = 0; t < Tn; ++t) {
    RmsNormBackward(&ws.h[t * D], p_[layout_.norm_f], ws.rstd_f[t], &ds[t * D], D, g[layout_.norm_f], &dh[t * D]);
  }
  for (int l = c_.n_layers - 1; l >= 0; --l) LayerBackward(l, ws, g, dh);

  // Embedding and input features.
  const T* inv_std = p_[layout_.norm_inv_std];
  std::vector<T> dxn(F);
  for (int t = 0; t < Tn; ++t) {
    std::fill(dxn.begin(), dxn.end(), T(0));
    AffineBackward(p_[layout_.embed.weight], &ws.xn[t * F], &dh[t * D], D, F, g[layout_.embed.weight],
                   g[layout_.embed.bias], dxn.data());
    if (dx) {
      for (int f = 0; f < F; ++f) dx[t * F + f] = dxn[f] * inv_std[f];
    }
  }
}

template <typename T>
void SequenceModel<T>::LayerBackward(int l, Workspace<T>& ws, Tensors<T>& g, std::vector<T>& dh) {
  const int D = c_.d_model, E = c_.d_inner(), N = c_.d_state, P = c_.headdim, Hh = c_.n_heads();
  const int W = c_.d_conv, cd = c_.conv_dim(), zd = c_.in_proj_dim(), Tn = ws.T_;
  const size_t S = c_.ssm_state_size();
  const LayerTensors& lt = layout_.layers[l];
  LayerActivations<T>& a = ws.layers[l];
  std::vector<T> dzx(static_cast<size_t>(Tn) * zd, T(0));  // d zxbcdt
  std::vector<T> dy(static_cast<size_t>(Tn) * E, T(0));
  std::vector<T> dq(E), dyn(E);

  // out_proj and gated norm.
  for (int t = 0; t < Tn; ++t) {
    std::fill(dyn.begin(), dyn.end(), T(0));
    AffineBackward<T>(p_[lt.out_proj], &a.yn[t * E], &dh[t * D], D, E, g[lt.out_proj], nullptr, dyn.data());
    std::fill(dq.begin(), dq.end(), T(0));
    RmsNormBackward(&a.q[t * E], p_[lt.mixer_norm], a.rstd_gate[t], dyn.data(), E, g[lt.mixer_norm], dq.data());
    const T* z = &a.zxbcdt[static_cast<size_t>(t) * zd];
    T* dz = &dzx[static_cast<size_t>(t) * zd];
    for (int e = 0; e < E; ++e) {
      dy[t * E + e] = dq[e] * Silu(z[e]);
      dz[e] = dq[e] * a.y[t * E + e] * SiluGrad(z[e]);
    }
  }

  // SSM, reverse scan.
  std::vector<T> dxbc(static_cast<size_t>(Tn) * cd, T(0));
  std::vector<T> ds(S, T(0));
  std::vector<T> dA(Hh, T(0));
  const T* Dp = p_[lt.d];
  const T* a_log = p_[lt.a_log];
  T* dD = g[lt.d];
  std::vector<T> ddt(static_cast<size_t>(Tn) * Hh, T(0));
  for (int t = Tn - 1; t >= 0; --t) {
    const T* prev = ws.StateRow(a, t, S);
    const T* cur = ws.StateRow(a, t + 1, S);
    const T* xs = &a.xbc[t * cd];
    const T* Bm = xs + E;
    const T* Cm = xs + E + N;
    T* dxs = &dxbc[t * cd];
    T* dB = dxs + E;
    T* dC = dxs + E + N;
    for (int hh = 0; hh < Hh; ++hh) {
      const T decay = a.decay[t * Hh + hh], dth = a.dt[t * Hh + hh];
      T d_decay = 0, d_dt = 0;
      for (int p = 0; p < P; ++p) {
        const int e = hh * P + p;
        const T dyv = dy[t * E + e];
        dD[hh] += dyv * xs[e];
        dxs[e] += dyv * Dp[hh];
        const size_t base = static_cast<size_t>(e) * N;
        T dx_b = 0;
        for (int n = 0; n < N; ++n) {
          const T gs = ds[base + n] + dyv * Cm[n];
          dC[n] += dyv * cur[base + n];
          d_decay += gs * prev[base + n];
          dB[n] += gs * dth * xs[e];
          dx_b += gs * Bm[n];
          ds[base + n] = gs * decay;
        }
        dxs[e] += dx_b * dth;
        d_dt += dx_b * xs[e];
      }
      const T A = -std::exp(a_log[hh]);
      d_dt += d_decay * decay * A;
      dA[hh] += d_decay * decay * dth;
      ddt[t * Hh + hh] = d_dt;
    }
  }
  for (int hh = 0; hh < Hh; ++hh) g[lt.a_log][hh] += dA[hh] * -std::exp(a_log[hh]);
  for (int t = 0; t < Tn; ++t) {
    for (int hh = 0; hh < Hh; ++hh) {
      const T dpre = ddt[t * Hh + hh] * SoftplusGrad(a.dt_pre[t * Hh + hh]);
      g[lt.dt_bias][hh] += dpre;
      dzx[static_cast<size_t>(t) * zd + E + cd + hh] = dpre;
    }
  }

  // Conv + SiLU.
  const T* cw = p_[lt.conv_weight];
  T* dcw = g[lt.conv_weight];
  T* dcb = g[lt.conv_bias];
  std::vector<T> dhist(static_cast<size_t>(Tn + W - 1) * cd, T(0));
  for (int t = 0; t < Tn; ++t) {
    for (int ch = 0; ch < cd; ++ch) {
      const T dpre = dxbc[t * cd + ch] * SiluGrad(a.conv_pre[t * cd + ch]);
      dcb[ch] += dpre;
      for (int k = 0; k < W; ++k) {
        const size_t row = static_cast<size_t>(t + k) * cd + ch;
        dcw[ch * W + k] += dpre * a.conv_hist[row];
        dhist[row] += dpre * cw[ch * W + k];
      }
    }
  }
  for (int t = 0; t < Tn; ++t) {
    std::copy_n(&dhist[static_cast<size_t>(t + W - 1) * cd], cd, &dzx[static_cast<size_t>(t) * zd + E]);
  }

  // in_proj, pre-norm, residual.
  std::vector<T> dr(D);
  for (int t = 0; t < Tn; ++t) {
    std::fill(dr.begin(), dr.end(), T(0));
    AffineBackward<T>(p_[lt.in_proj], &a.r[t * D], &dzx[static_cast<size_t>(t) * zd], zd, D, g[lt.in_proj], nullptr,
                      dr.data());
    RmsNormBackward(&a.h_in[t * D], p_[lt.norm], a.rstd[t], dr.data(), D, g[lt.norm], &dh[t * D]);
  }
}

// dlogits of the masked BCE (MODEL.md §2.7): m·(σ(l) − y) / max(Σm, 1). Counted in double, as the CUDA loss counts:
// a float count stops being exact past 2^24 entries (a day's stream of five horizons).
template <typename T>
T MaskCount(std::span<const T> mask) {
  double total = 0;
  for (T m : mask) total += static_cast<double>(m);
  return static_cast<T>(std::max(total, 1.0));
}

}  // namespace

template <typename T>
StreamState<T> StreamState<T>::Zero(const ModelConfig& c) {
  StreamState<T> s;
  s.conv.assign(static_cast<size_t>(c.n_layers) * c.conv_state_size(), T(0));
  s.ssm.assign(static_cast<size_t>(c.n_layers) * c.ssm_state_size(), T(0));
  s.cfc.assign(c.cfc_units, T(0));
  return s;
}

template <typename T>
CpuReference<T>::CpuReference(const ParamLayout& layout, int threads)
    : layout_(layout),
      threads_(threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency())) {}

template <typename T>
void CpuReference<T>::Forward(std::span<const T> params, const BatchView<T>& batch, std::span<T> logits,
                              std::span<StreamState<T>> states) const {
  const ModelConfig& c = layout_.config();
  const int Tn = batch.window, F = c.n_features, H = c.n_horizons;
  std::vector<Workspace<T>> workspaces;
  const int workers = std::max(1, std::min(threads_, batch.batch));
  for (int w = 0; w < workers; ++w) workspaces.emplace_back(c, Tn, /*keep_states=*/false);
  ParallelFor(batch.batch, workers, [&](int b, int w) {
    SequenceModel<T> model(layout_, params.data());
    model.Forward(batch.x.data() + static_cast<size_t>(b) * Tn * F, batch.dt.data() + static_cast<size_t>(b) * Tn,
                  workspaces[w], states.empty() ? nullptr : &states[b],
                  logits.data() + static_cast<size_t>(b) * Tn * H);
  });
}

template <typename T>
T CpuReference<T>::LossAndGradients(std::span<const T> params, const BatchView<T>& batch, std::span<T> grads,
                                    std::span<T> dx, std::span<StreamState<T>> states) const {
  const ModelConfig& c = layout_.config();
  const int Tn = batch.window, F = c.n_features, H = c.n_horizons;
  const size_t per_seq = static_cast<size_t>(Tn) * H;
  const T denom = MaskCount(batch.mask);
  // The sums' order, and so their bits, must not depend on the machine: sequence b adds into group b mod
  // kGradientGroups in b's order, the groups are added in theirs, and the workers only share the groups out.
  const int groups = std::min(kGradientGroups, batch.batch);
  const int workers = std::max(1, std::min(threads_, groups));
  std::vector<Workspace<T>> workspaces;
  std::vector<std::vector<T>> group_grads(groups, std::vector<T>(layout_.total_size(), T(0)));
  std::vector<T> group_loss(groups, T(0));
  for (int w = 0; w < workers; ++w) workspaces.emplace_back(c, Tn, /*keep_states=*/true);
  ParallelFor(groups, workers, [&](int g, int w) {
    SequenceModel<T> model(layout_, params.data());
    std::vector<T> logits(per_seq), dlogits(per_seq);
    for (int b = g; b < batch.batch; b += groups) {
      const T* x = batch.x.data() + static_cast<size_t>(b) * Tn * F;
      const T* dt = batch.dt.data() + static_cast<size_t>(b) * Tn;
      model.Forward(x, dt, workspaces[w], states.empty() ? nullptr : &states[b], logits.data());
      const T* y = batch.labels.data() + b * per_seq;
      const T* m = batch.mask.data() + b * per_seq;
      for (size_t i = 0; i < per_seq; ++i) {
        group_loss[g] += m[i] * Bce(logits[i], y[i]);
        dlogits[i] = m[i] * (Sigmoid(logits[i]) - y[i]) / denom;
      }
      model.Backward(dt, dlogits.data(), workspaces[w], group_grads[g].data(),
                     dx.empty() ? nullptr : dx.data() + static_cast<size_t>(b) * Tn * F);
    }
  });
  std::fill(grads.begin(), grads.end(), T(0));
  T loss = 0;
  for (int g = 0; g < groups; ++g) {
    for (size_t i = layout_.trained_begin(); i < grads.size(); ++i) grads[i] += group_grads[g][i];
    loss += group_loss[g];
  }
  return loss / denom;
}

// Summed in double, as the CUDA loss sums: a float sum over a whole evaluated stream (millions of terms) drifted
// past MODEL.md §8's 1e-5 (2.4e-3 relative at 5M terms).
template <typename T>
T CpuReference<T>::MaskedBce(std::span<const T> logits, std::span<const T> labels, std::span<const T> mask) {
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) total += static_cast<double>(mask[i] * Bce(logits[i], labels[i]));
  return static_cast<T>(total / static_cast<double>(MaskCount(mask)));
}

template <typename T>
void CpuReference<T>::Step(std::span<const T> params, std::span<const T> u, T dt, StreamState<T>& state,
                           std::span<T> logits) const {
  const ModelConfig& c = layout_.config();
  const int F = c.n_features, D = c.d_model, E = c.d_inner(), N = c.d_state, P = c.headdim, Hh = c.n_heads();
  const int W = c.d_conv, cd = c.conv_dim(), zd = c.in_proj_dim(), C = c.cfc_units, K = c.cfc_backbone;
  const int G = c.grn_hidden, H = c.n_horizons, DC = c.head_input();
  const size_t S = c.ssm_state_size();
  Tensors<const T> p(layout_, params.data());

  std::vector<T> xn(F), h(D), r(D), zx(zd), xbc(cd), y(E), q(E), yn(E), out(D);
  for (int f = 0; f < F; ++f) xn[f] = (u[f] - p[layout_.norm_mean][f]) * p[layout_.norm_inv_std][f];
  Affine(p[layout_.embed.weight], p[layout_.embed.bias], xn.data(), D, F, h.data());
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerTensors& lt = layout_.layers[l];
    RmsNorm(h.data(), p[lt.norm], D, r.data());
    Affine<T>(p[lt.in_proj], nullptr, r.data(), zd, D, zx.data());
    // Conv over the rolling state (oldest first) and the new input, then shift the state.
    T* conv_state = state.conv.data() + static_cast<size_t>(l) * (W - 1) * cd;
    const T* x_new = zx.data() + E;
    for (int ch = 0; ch < cd; ++ch) {
      T acc = p[lt.conv_bias][ch] + p[lt.conv_weight][ch * W + W - 1] * x_new[ch];
      for (int k = 0; k < W - 1; ++k) acc += p[lt.conv_weight][ch * W + k] * conv_state[k * cd + ch];
      xbc[ch] = Silu(acc);
    }
    for (int k = 0; k + 1 < W - 1; ++k) std::copy_n(conv_state + (k + 1) * cd, cd, conv_state + k * cd);
    if (W > 1) std::copy_n(x_new, cd, conv_state + (W - 2) * cd);
    // SSM update and readout.
    T* s = state.ssm.data() + l * S;
    const T* Bm = xbc.data() + E;
    const T* Cm = xbc.data() + E + N;
    for (int hh = 0; hh < Hh; ++hh) {
      const T dth = Softplus(zx[E + cd + hh] + p[lt.dt_bias][hh]);
      const T decay = std::exp(dth * -std::exp(p[lt.a_log][hh]));
      for (int pp = 0; pp < P; ++pp) {
        const int e = hh * P + pp;
        T acc = 0;
        for (int n = 0; n < N; ++n) {
          T& sv = s[static_cast<size_t>(e) * N + n];
          sv = decay * sv + dth * xbc[e] * Bm[n];
          acc += Cm[n] * sv;
        }
        y[e] = acc + p[lt.d][hh] * xbc[e];
      }
    }
    for (int e = 0; e < E; ++e) q[e] = y[e] * Silu(zx[e]);
    RmsNorm(q.data(), p[lt.mixer_norm], E, yn.data());
    Affine<T>(p[lt.out_proj], nullptr, yn.data(), D, E, out.data());
    for (int d = 0; d < D; ++d) h[d] += out[d];
  }
  std::vector<T> a(DC), bb(K), p1(C), p2(C), ta(C), tb(C);
  RmsNorm(h.data(), p[layout_.norm_f], D, a.data());  // a = [s ; c_prev] for the CfC backbone
  std::copy(state.cfc.begin(), state.cfc.end(), a.begin() + D);
  Affine(p[layout_.cfc_backbone.weight], p[layout_.cfc_backbone.bias], a.data(), K, DC, bb.data());
  for (T& v : bb) v = LecunTanh(v);
  Affine(p[layout_.cfc_ff1.weight], p[layout_.cfc_ff1.bias], bb.data(), C, K, p1.data());
  Affine(p[layout_.cfc_ff2.weight], p[layout_.cfc_ff2.bias], bb.data(), C, K, p2.data());
  Affine(p[layout_.cfc_time_a.weight], p[layout_.cfc_time_a.bias], bb.data(), C, K, ta.data());
  Affine(p[layout_.cfc_time_b.weight], p[layout_.cfc_time_b.bias], bb.data(), C, K, tb.data());
  for (int i = 0; i < C; ++i) {
    const T tau = Sigmoid(ta[i] * dt + tb[i]);
    state.cfc[i] = std::tanh(p1[i]) * (T(1) - tau) + tau * std::tanh(p2[i]);
  }
  std::copy(state.cfc.begin(), state.cfc.end(), a.begin() + D);  // head input [s ; c_t]
  std::vector<T> e2(G), e1(G), gate(G), value(G), pre_ln(G);
  Affine(p[layout_.grn_fc2.weight], p[layout_.grn_fc2.bias], a.data(), G, DC, e2.data());
  for (T& v : e2) v = Elu(v);
  Affine(p[layout_.grn_fc1.weight], p[layout_.grn_fc1.bias], e2.data(), G, G, e1.data());
  Affine(p[layout_.grn_gate.weight], p[layout_.grn_gate.bias], e1.data(), G, G, gate.data());
  Affine(p[layout_.grn_value.weight], p[layout_.grn_value.bias], e1.data(), G, G, value.data());
  Affine<T>(p[layout_.grn_skip], nullptr, a.data(), G, DC, pre_ln.data());
  T mean = 0;
  for (int i = 0; i < G; ++i) {
    pre_ln[i] += Sigmoid(gate[i]) * value[i];
    mean += pre_ln[i];
  }
  mean /= T(G);
  T var = 0;
  for (int i = 0; i < G; ++i) var += (pre_ln[i] - mean) * (pre_ln[i] - mean);
  const T rstd = T(1) / std::sqrt(var / T(G) + T(kNormEps));
  for (int i = 0; i < G; ++i) {
    pre_ln[i] = (pre_ln[i] - mean) * rstd * p[layout_.grn_norm.weight][i] + p[layout_.grn_norm.bias][i];
  }
  Affine(p[layout_.head_out.weight], p[layout_.head_out.bias], pre_ln.data(), H, G, logits.data());
}

template <typename T>
void CpuReference<T>::StepMany(std::span<const T> params, std::span<const T> x, std::span<const T> dt,
                               std::span<StreamState<T>* const> states, std::span<T> logits) const {
  const size_t F = layout_.config().n_features, H = layout_.config().n_horizons;
  ParallelFor(static_cast<int>(dt.size()), threads_, [&](int i, int) {
    Step(params, x.subspan(i * F, F), dt[i], *states[i], logits.subspan(i * H, H));
  });
}

// |σ(l) − ½| grows with |l|, so the logits pick the horizon: rounded probabilities would split exact ties (σ(−l) and
// σ(l) round differently) and tie every float32 logit past ~17 at ½.
template <typename T>
T Conviction(std::span<const T> logits) {
  size_t best = 0;
  T best_magnitude = -1;
  for (size_t h = 0; h < logits.size(); ++h) {
    if (std::abs(logits[h]) > best_magnitude) {
      best = h;
      best_magnitude = std::abs(logits[h]);
    }
  }
  return T(2) * Sigmoid(logits[best]) - T(1);
}

template struct StreamState<float>;
template struct StreamState<double>;
template class CpuReference<float>;
template class CpuReference<double>;
template float Conviction<float>(std::span<const float>);
template double Conviction<double>(std::span<const double>);

}  // namespace perception
