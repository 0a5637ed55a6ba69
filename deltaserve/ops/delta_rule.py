"""The gated delta rule of Gated DeltaNet, per value head, in fp32.

    S_t = exp(g_t) * S_{t-1}
    u_t = beta_t * (v_t - S_t^T k_t)
    S_t = S_t + k_t u_t^T
    o_t = S_t^T q_t

Inputs are already expanded to value heads (key head j // (Hv/Hk) serves value head j), q and k already
L2-normalised and q scaled. Shapes: q, k [T, H, dk]; v [T, H, dv]; g, beta [T, H]; state [H, dk, dv].
Three implementations with identical results (to fp32 rounding):
- `delta_rule_reference`: the recurrence, one token at a time (the oracle the tests use);
- `delta_rule_chunked`: the chunked WY/UT form for prefill, parallel within a chunk of 64;
- `delta_rule_step`: one token for a batch of sequences (decode);
- `delta_rule_recurrent`: a few tokens for a batch of sequences, keeping the state after every token
  (speculative verification needs the state at each accepted position).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def delta_rule_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, dk = k.shape
    dv = v.shape[-1]
    state = (torch.zeros(H, dk, dv) if initial_state is None else initial_state).float().clone()
    out = torch.empty(T, H, dv, dtype=torch.float32)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    for t in range(T):
        state = state * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token for B sequences: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv]."""
    state = state * g.float().exp()[..., None, None]
    kv_mem = torch.einsum("bhkv,bhk->bhv", state, k.float())  # [B, H, dv]
    u = beta.float()[..., None] * (v.float() - kv_mem)
    state = state + k.float()[..., :, None] * u[..., None, :]
    out = torch.einsum("bhkv,bhk->bhv", state, q.float())
    return out, state


def delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens for B sequences, q, k [B, L, H, dk] ...; returns out [B, L, H, dv] and the states after
    every token, [B, L, H, dk, dv]."""
    B, L = q.shape[:2]
    outs, states = [], []
    for t in range(L):
        o, state = delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
        states.append(state)
    return torch.stack(outs, 1), torch.stack(states, 1)


def delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of T tokens. Within a chunk of C tokens, with gamma the cumulative log-decay and S0 the
    state entering the chunk, the updates u solve (I + A) U = beta*V - beta*exp(gamma)*K S0 where
    A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j for j < i; T = (I + A)^-1 is applied by forward
    substitution. Everything that does not depend on S0 is computed for all chunks at once; only the
    carry of the state is a loop over chunks."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    n = (T + C - 1) // C
    pad = n * C - T
    # Padding with g = 0 and beta = 0 leaves the state unchanged and earlier outputs untouched.
    q, k, v, g, beta = (F.pad(x.float(), (0, 0) * (x.dim() - 1) + (0, pad)) for x in (q, k, v, g, beta))
    # -> [H, n, C, ...]
    q = q.view(n, C, H, dk).permute(2, 0, 1, 3)
    k = k.view(n, C, H, dk).permute(2, 0, 1, 3)
    v = v.view(n, C, H, dv).permute(2, 0, 1, 3)
    g = g.view(n, C, H).permute(2, 0, 1)
    beta = beta.view(n, C, H).permute(2, 0, 1)

    gamma = g.cumsum(-1)  # [H, n, C]
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    diff = gamma[..., :, None] - gamma[..., None, :]  # [H, n, C, C] gamma_i - gamma_j
    decay = diff.masked_fill(~causal, float("-inf")).exp()  # zero above the diagonal, no overflow

    kk = k @ k.transpose(-1, -2)  # [H, n, C, C]
    a = (beta[..., :, None] * kk * decay).masked_fill(~strict, 0.0)
    eye = torch.eye(C)
    system = a + eye
    rhs = torch.cat([beta[..., None] * v, (beta * gamma.exp())[..., None] * k], dim=-1)  # [H, n, C, dv+dk]
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    v_part, w = solved[..., :dv], solved[..., dv:]  # U = v_part - w @ S0

    qk = (q @ k.transpose(-1, -2)) * decay  # [H, n, C, C], causal incl. diagonal
    q_decayed = q * gamma.exp()[..., None]  # reads of S0
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]  # writes that reach the end of the chunk
    chunk_decay = gamma[..., -1].exp()  # [H, n]

    state = torch.zeros(H, dk, dv) if initial_state is None else initial_state.float().clone()
    out = torch.empty(H, n, C, dv)
    for i in range(n):
        u = v_part[:, i] - w[:, i] @ state  # [H, C, dv]
        out[:, i] = q_decayed[:, i] @ state + qk[:, i] @ u
        state = state * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    out = out.reshape(H, n * C, dv).transpose(0, 1)[:T]
    return out, state
