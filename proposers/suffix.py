"""``suffix``: suffix-tree drafting over this request's prompt + output and earlier requests' outputs.

Two depth-bounded suffix trees with occurrence counts:

* a **local** tree per request (in ``seq.scratch``) over its prompt and every accepted token, grown one
  token at a time as tokens are accepted (O(max_depth) per token);
* a **global** cache held by the proposer instance over the outputs of finished requests (each with the
  last ``prompt_tail`` prompt tokens in front of it, so a later sample of the same prompt matches from its
  first token). It is bounded by ``max_cached_requests`` and ``max_cached_tokens`` and evicts the oldest
  request first; ``memory_bytes()`` / ``stats()`` report its size (about 200 bytes a cached token on code).
  A request's output enters it once, when the request ends; requests still decoding follow it with
  per-request cursors (O(max_depth) per accepted token, rebuilt after the cache changes), so concurrent
  requests never write into each other's state.

A node of a tree is a context string s (at most ``max_depth`` tokens); its count is the number of
occurrences of s in the indexed sequences, so the counts of its children are the **continuation
frequencies** of s. To draft, each tree finds the longest suffix of the current context (leaving room for
the draft under the depth bound) that occurred before with a continuation; the tree whose greedy path scores
higher (the sum of the path's estimated probabilities, as in ArcticInference) drafts. At each drafted
position q is the continuation-frequency distribution at the current node, and the token is drawn from
exactly that q with ``seq.rng``; under greedy decoding it is the argmax (ties: the most recent occurrence)
and q is reported as the one-hot of that argmax. Drafting continues from the drawn token. Positions with a
single continuation need no V-sized row; a proposal whose rows are all one-hot is a point-mass Proposal.

The draft length adapts: at most ``factor`` x match length tokens (and k), and the next position is drafted
only while the path's estimated probability times the best continuation's frequency stays at or above
``min_token_prob``. That decision is taken *before* the token is drawn, so it cannot bias the draw.

Only accepted tokens (``seq.ids``) are ever indexed; rejected drafts never enter either tree.
"""
from __future__ import annotations

import sys
import weakref
from array import array
from collections import OrderedDict
from itertools import count as _counter

import torch

from specplug.plugins.hookspecs import hookimpl
from specplug.sampling import q_from_counts
from specplug.tree_drafting import best_first, node_budget, point_mass_tree, tree_budget
from specplug.types import Proposal, Proposer, SequenceState, Verdict
from specplug.verifier import TreeProposal

__all__ = ["SuffixProposer", "SuffixCache", "SuffixTree"]


class _Tokens(array):
    """A token buffer (4 bytes a token) with an id: a larger ``uid`` was written more recently."""

    __slots__ = ("uid",)

    def __new__(cls, uid: int, tokens=()):
        self = super().__new__(cls, "i", tokens)
        self.uid = uid
        return self


class _Writer:
    """Appends one sequence to a tree: its buffer and the nodes where its last max_depth suffixes end."""

    __slots__ = ("tokens", "active")

    def __init__(self, tokens: _Tokens):
        self.tokens = tokens
        self.active: list[int] = []  # longest suffix first; depth[active[j]] == len(active) - j


ROOT = 0


class SuffixTree:
    """A path-compressed suffix tree of depth at most ``max_depth`` with occurrence counts.

    Every suffix of every indexed sequence, cut to ``max_depth`` tokens, is counted along its path. A node is
    a context string; its count is how many indexed suffixes pass through or end at it, so its children's
    counts are the string's continuation frequencies. Nodes exist only where paths branch or a suffix ends:
    at most two per indexed token. Appending a token extends the sequence's last max_depth suffixes
    (O(max_depth)); removing a sequence walks its suffixes and decrements (O(len x max_depth)).

    Storage is struct-of-arrays: node ``n`` is ``parent[n]``, ``count[n]``, ``depth[n]`` and one occurrence of
    its string, ``bufs[buf[n]][end[n] - depth[n]:end[n]]`` (edge labels are not stored); ``kids[n]`` maps the
    first token of each child's edge to the child. Only ints are stored, so the garbage collector never
    walks the tree (a million cached tokens would otherwise add over a second to every full collection).

    Removal keeps every node's buffer alive only if sequences are removed in the order they were written
    and written one at a time (the global cache's FIFO): a node always points at the most recently written
    sequence containing it, and the oldest sequence is contained only by nodes that die with it.
    """

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.parent = array("i", [-1])
        self.count = array("i", [0])
        self.depth = array("i", [0])
        self.buf = array("i", [0])
        self.end = array("i", [0])
        self.kids: list[dict[int, int] | None] = [None]
        self.free: list[int] = []  # ids of removed nodes, reused first
        self.bufs: dict[int, _Tokens] = {}
        self.num_nodes = 0  # without the root
        self.num_dicts = 0
        self.version = 0  # bumped by every change that can move or delete nodes (readers' cursors)

    # --- writing ----------------------------------------------------------------------------------
    def writer(self, tokens: _Tokens) -> _Writer:
        self.bufs[tokens.uid] = tokens
        return _Writer(tokens)

    def append(self, w: _Writer, token: int) -> None:
        """Append ``token`` to the writer's sequence: extend its active suffixes and start a new one."""
        toks = w.tokens
        toks.append(token)
        end, b = len(toks), toks.uid
        active = w.active
        if len(active) >= self.max_depth:  # the oldest suffix is complete at max_depth tokens
            active = active[len(active) - self.max_depth + 1:]
        active.append(ROOT)
        kids, count, depth, ends, extend = self.kids, self.count, self.depth, self.end, self._extend
        grown = []
        for a in active:
            if count[a] == 1 and kids[a] is None and a != ROOT:
                # the common case, inlined: a leaf holding only this suffix (already ending in this buffer,
                # one token before): lengthen its edge
                depth[a] += 1
                ends[a] = end
                grown.append(a)
            else:
                grown.append(extend(a, token, b, end))
        w.active = grown

    def extend(self, w: _Writer, tokens) -> None:
        for t in tokens:
            self.append(w, t)

    def _new(self, parent: int, depth: int, count: int, b: int, end: int) -> int:
        self.num_nodes += 1
        if self.free:
            n = self.free.pop()
            self.parent[n], self.count[n], self.depth[n], self.buf[n], self.end[n] = parent, count, depth, b, end
            return n
        self.parent.append(parent)
        self.count.append(count)
        self.depth.append(depth)
        self.buf.append(b)
        self.end.append(end)
        self.kids.append(None)
        return len(self.kids) - 1

    def _extend(self, a: int, x: int, b: int, end: int) -> int:
        """The suffix ending at node ``a`` grows by ``x`` (now ending at ``end`` in buffer ``b``): return the
        node where it ends now."""
        kids, count, depth = self.kids, self.count, self.depth
        ch = kids[a]
        child = ch.get(x) if ch is not None else None
        if child is None:
            if ch is None and a != ROOT and count[a] == 1:
                # a leaf holding only this suffix: lengthen its edge
                depth[a] += 1
                self.buf[a] = b
                self.end[a] = end
                return a
            new = self._new(a, depth[a] + 1, 1, b, end)
            if ch is None:
                kids[a] = {x: new}
                self.num_dicts += 1
            else:
                ch[x] = new
            return new  # a keeps its other children or its other suffixes: nothing to merge
        d1 = depth[a] + 1
        if depth[child] == d1:
            count[child] += 1
            self.buf[child] = b
            self.end[child] = end
            new = child
        elif a != ROOT and len(ch) == 1 and count[a] == count[child] + 1:
            # only this suffix ends at a and it continues along a's one edge: a slides one token down that edge
            # (what splitting the edge and merging a away would make, without a node made and freed)
            depth[a] = d1
            self.buf[a] = b
            self.end[a] = end
            ch.clear()
            ch[self.token(child, d1)] = child
            return a
        else:  # the suffix now ends inside child's edge: split it after its first token
            new = self._new(a, d1, count[child] + 1, b, end)
            ch[x] = new
            self.parent[child] = new
            kids[new] = {self.token(child, d1): child}
            self.num_dicts += 1
        if a != ROOT and len(ch) == 1 and count[a] == count[new]:
            self._merge(a, new)  # no suffix ends at a any more and it has one child
        return new

    def _merge(self, a: int, child: int) -> None:
        """Remove ``a`` (no suffix ends there, one child): its child takes its place under its parent."""
        p = self.parent[a]
        self.kids[p][self.token(child, self.depth[p])] = child
        self.parent[child] = p
        self.kids[a] = None
        self.free.append(a)
        self.num_nodes -= 1
        self.num_dicts -= 1

    def remove(self, uid: int) -> None:
        """Uncount every suffix of a sequence written earlier; nodes left with no occurrence are freed."""
        toks = self.bufs[uid]
        kids, count, depth = self.kids, self.count, self.depth
        depth_cap, n = self.max_depth, len(toks)
        for i in range(n):
            length = min(depth_cap, n - i)
            node = ROOT
            while depth[node] < length:
                key = toks[i + depth[node]]
                ch = kids[node]
                child = ch[key]
                count[child] -= 1
                if count[child] == 0:
                    del ch[key]
                    if not ch:
                        kids[node] = None
                        self.num_dicts -= 1
                    self._free(child)
                    break
                node = child
            ch = kids[node]
            if node != ROOT and ch is not None and len(ch) == 1:
                (child,) = ch.values()
                if count[child] == count[node]:
                    self._merge(node, child)
        del self.bufs[uid]
        self.version += 1

    def _free(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            self.num_nodes -= 1
            if self.kids[n] is not None:
                self.num_dicts -= 1
                stack.extend(self.kids[n].values())
                self.kids[n] = None
            self.free.append(n)

    # --- reading ----------------------------------------------------------------------------------
    def token(self, n: int, d: int) -> int:
        """Token ``d`` (0-based) of node ``n``'s string."""
        return self.bufs[self.buf[n]][self.end[n] - self.depth[n] + d]

    def string(self, n: int) -> tuple[int, ...]:
        e = self.end[n]
        return tuple(self.bufs[self.buf[n]][e - self.depth[n]:e]) if n != ROOT else ()

    def advance(self, node: int, d: int, x: int) -> int | None:
        """From the point ``d`` tokens deep, on ``node``'s edge or at its end, follow token ``x``."""
        if d < self.depth[node]:
            return node if self.token(node, d) == x else None
        ch = self.kids[node]
        return ch.get(x) if ch is not None else None

    def locate(self, tokens) -> int | None:
        """The node whose edge holds the end of the string ``tokens``, or None if it never occurred."""
        node, d = ROOT, 0
        for x in tokens:
            node = self.advance(node, d, x)
            if node is None:
                return None
            d += 1
        return node

    def substring_counts(self) -> dict[tuple[int, ...], int]:
        """Every context string the tree holds with its count (tests compare it with brute force)."""
        out: dict[tuple[int, ...], int] = {}
        stack = list(self.kids[ROOT].values()) if self.kids[ROOT] else []
        while stack:
            n = stack.pop()
            s = self.string(n)
            for d in range(self.depth[self.parent[n]] + 1, self.depth[n] + 1):
                out[s[:d]] = self.count[n]
            if self.kids[n]:
                stack.extend(self.kids[n].values())
        return out

    def check(self) -> None:
        """Structural invariants (tests): parents, edge keys, counts, compression, node bookkeeping."""
        nodes = dicts = 0
        stack = [ROOT]
        seen = set()
        while stack:
            n = stack.pop()
            seen.add(n)
            ch = self.kids[n]
            if n != ROOT:
                nodes += 1
                p = self.parent[n]
                assert 0 < self.count[n] and self.depth[p] < self.depth[n] <= self.max_depth
                assert self.buf[n] in self.bufs and self.end[n] <= len(self.bufs[self.buf[n]])
            if ch is not None:
                dicts += 1
                assert ch, "empty children dict"
                for key, c in ch.items():
                    assert self.parent[c] == n and self.token(c, self.depth[n]) == key
                    assert self.string(c)[:self.depth[n]] == self.string(n)
                if n != ROOT:
                    total = sum(self.count[c] for c in ch.values())
                    assert total <= self.count[n]
                    assert len(ch) > 1 or total < self.count[n], "uncompressed chain"
                stack.extend(ch.values())
        assert nodes == self.num_nodes and dicts == self.num_dicts, (nodes, self.num_nodes, dicts, self.num_dicts)
        assert not seen & set(self.free) and len(seen) + len(self.free) == len(self.kids)


# bytes a node costs: 5 int32 fields, a list slot, the int objects for its id and its edge's first token
_NODE_BYTES = 5 * 4 + 8 + 2 * sys.getsizeof(1 << 20)
_DICT_BYTES = sys.getsizeof({1: 1})
_ENTRY_BYTES = (sys.getsizeof({i: i for i in range(11)}) - sys.getsizeof({i: i for i in range(6)})) // 5


def _tree_bytes(tree: SuffixTree) -> int:
    # capacity (freed ids are kept for reuse) and the children dicts; every non-root node is one dict entry,
    # and a dict of <= 5 entries costs _DICT_BYTES
    extra_entries = max(0, tree.num_nodes - 5 * tree.num_dicts)
    return (len(tree.kids) * _NODE_BYTES + tree.num_dicts * _DICT_BYTES + extra_entries * _ENTRY_BYTES
            + 8 * len(tree.free))


class SuffixCache:
    """The global cache: one suffix tree over the outputs of finished requests, oldest evicted first.

    Bounded by ``max_requests`` sequences and ``max_tokens`` tokens (a sequence longer than that keeps its
    last ``max_tokens``); a bound of 0 disables the cache, a negative one removes the bound.
    """

    def __init__(self, max_depth: int = 64, max_requests: int = 10_000, max_tokens: int = 1_000_000):
        self.tree = SuffixTree(max_depth)
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.sequences: OrderedDict[int, _Tokens] = OrderedDict()  # uid -> tokens, oldest first
        self.num_tokens = 0
        self.evicted = 0
        self._uids = _counter()

    @property
    def version(self) -> int:
        return self.tree.version

    @property
    def enabled(self) -> bool:
        return self.max_requests != 0 and self.max_tokens != 0

    def add(self, tokens) -> None:
        """Index one finished sequence, after evicting the oldest ones it would not fit beside."""
        if not self.enabled or not len(tokens):
            return
        tokens = list(tokens)
        if 0 < self.max_tokens < len(tokens):
            tokens = tokens[len(tokens) - self.max_tokens:]
        while self.sequences and (
                (self.max_requests > 0 and len(self.sequences) >= self.max_requests)
                or (self.max_tokens > 0 and self.num_tokens + len(tokens) > self.max_tokens)):
            self.evict_oldest()
        seq = _Tokens(next(self._uids))
        self.tree.extend(self.tree.writer(seq), tokens)
        self.sequences[seq.uid] = seq
        self.num_tokens += len(seq)
        self.tree.version += 1

    def evict_oldest(self) -> None:
        uid, seq = self.sequences.popitem(last=False)
        self.tree.remove(uid)
        self.num_tokens -= len(seq)
        self.evicted += 1

    def check(self) -> None:
        """Invariants (tests): the tree's, and its buffers are exactly the cached sequences."""
        self.tree.check()
        assert self.tree.bufs == self.sequences
        assert self.num_tokens == sum(map(len, self.sequences.values()))

    def memory_bytes(self) -> int:
        return _tree_bytes(self.tree) + self.num_tokens * 4 + len(self.sequences) * sys.getsizeof(_Tokens(0))

    def stats(self) -> dict:
        return {"requests": len(self.sequences), "tokens": self.num_tokens, "nodes": self.tree.num_nodes,
                "evicted_requests": self.evicted, "memory_bytes": self.memory_bytes()}


class _SeqState:
    """One request's private state: its local tree (prompt + accepted tokens) and its global cursors."""

    __slots__ = ("tree", "writer", "cursors", "version", "__weakref__")

    def __init__(self, max_depth: int):
        self.tree = SuffixTree(max_depth)
        self.writer = self.tree.writer(_Tokens(0))
        # cursors[m] = the global node whose edge holds the end of the context's last m tokens; [0] = root
        self.cursors: list[int] = []
        self.version = -1

    @property
    def indexed(self) -> int:
        return len(self.writer.tokens)

    def memory_bytes(self) -> int:
        return _tree_bytes(self.tree) + self.indexed * 4 + len(self.cursors) * 8


class SuffixProposer(Proposer):
    """Suffix-tree drafting with a continuation-frequency q; see the module docstring."""

    name = "suffix"

    def __init__(self, target=None, max_depth: int = 16, factor: float = 1.0, min_token_prob: float = 0.1,
                 max_cached_requests: int = 10_000, max_cached_tokens: int = 1_000_000, prompt_tail: int = 16,
                 tree: int = 0):
        """``tree``: a node budget: draft several continuations of the matched node as a tree of at most this
        many nodes (see :meth:`propose_tree`); 0 drafts one continuation, a chain.

        ``max_depth`` 16 rather than SuffixDecoding's 64: on the zoo's code a match of at most 16 - k tokens
        drafted as well or better (HumanEval γ = 6: 3.42 tokens a step against 2.98) and every accepted token
        indexes a quarter of the active suffixes (docs/proposers.md)."""
        if max_depth < 1:
            raise ValueError(f"suffix: max_depth must be >= 1, got {max_depth}")
        if factor < 0:
            raise ValueError(f"suffix: factor must be >= 0, got {factor}")
        if not 0 <= min_token_prob <= 1:
            raise ValueError(f"suffix: min_token_prob must lie in [0, 1], got {min_token_prob}")
        if prompt_tail < 0:
            raise ValueError(f"suffix: prompt_tail must be >= 0, got {prompt_tail}")
        self.max_depth, self.factor, self.min_token_prob = max_depth, factor, min_token_prob
        self.prompt_tail = prompt_tail
        self.tree = tree_budget(tree, "suffix")
        self.cache = SuffixCache(max_depth, max_cached_requests, max_cached_tokens)
        self._live: weakref.WeakSet[_SeqState] = weakref.WeakSet()

    # --- per-request state ------------------------------------------------------------------------
    def begin(self, seq: SequenceState) -> None:
        state = _SeqState(self.max_depth)
        seq.scratch[self.name] = state
        self._live.add(state)
        self._sync(seq)

    def _sync(self, seq: SequenceState) -> _SeqState:
        """Index the accepted tokens the state has not seen (all of them after a rebuild)."""
        state = seq.scratch.get(self.name)
        ids = seq.ids
        if state is None or len(ids) < state.indexed:  # no begin(), or tokens were taken back: start over
            state = _SeqState(self.max_depth)
            seq.scratch[self.name] = state
            self._live.add(state)
        new = ids[state.indexed:]
        current = state.version == self.cache.version
        if new:
            tree, w = state.tree, state.writer
            advance = self.cache.tree.advance
            cursors = state.cursors
            for x in new:
                tree.append(w, x)
                if current:
                    grown = [ROOT]
                    for m, node in enumerate(cursors):
                        node = advance(node, m, x)
                        if node is None:  # a longer suffix cannot occur if this one does not
                            break
                        grown.append(node)
                    cursors = grown
            state.cursors = cursors
        if not current:
            self._relocate(state)
        return state

    def _relocate(self, state: _SeqState) -> None:
        """The global tree changed: find the cached positions of the context's suffixes from scratch."""
        toks = state.writer.tokens
        n = len(toks)
        cursors = [ROOT]
        for length in range(1, min(self.max_depth, n) + 1):
            node = self.cache.tree.locate(toks[n - length:])
            if node is None:  # a longer suffix cannot occur if this one does not
                break
            cursors.append(node)
        state.cursors = cursors
        state.version = self.cache.version

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        self._sync(seq)  # index the accepted tokens now, so propose stays cheap

    def end(self, seq: SequenceState) -> None:
        state = seq.scratch.pop(self.name, None)
        if state is not None:
            self._live.discard(state)
        tail = seq.ids[max(0, seq.num_prompt - self.prompt_tail):seq.num_prompt] if self.prompt_tail else []
        if seq.output_ids:
            self.cache.add(list(tail) + list(seq.output_ids))

    # --- drafting ---------------------------------------------------------------------------------
    def _candidates(self, state: _SeqState, k: int):
        """(tree, node, match length, max draft length) for the longest usable match in each tree."""
        depth_cap = self.max_depth
        m_cap = max(1, depth_cap - k)  # leave room for k tokens under the depth bound
        out = []
        local = state.tree
        active = state.writer.active  # local endpoints, longest first; their depths are len - j
        for j in range(max(0, len(active) - m_cap), len(active)):
            node = active[j]
            if local.kids[node]:
                out.append((local, node, len(active) - j))
                break
        glob = self.cache.tree
        cursors = state.cursors
        for m in range(min(m_cap, len(cursors) - 1), 0, -1):
            node = cursors[m]
            if m < glob.depth[node] or glob.kids[node]:
                out.append((glob, node, m))
                break
        result = []
        for tree, node, m in out:
            max_len = min(k, int(self.factor * m + 1e-9), depth_cap - m)
            if max_len > 0:
                result.append((tree, node, m, max_len))
        return result

    def _walk(self, tree: SuffixTree, node: int, d: int, max_len: int, uniforms=None):
        """Draft up to ``max_len`` tokens from the point ``d`` tokens deep on ``node``. Returns (tokens, rows,
        score): rows[i] is None where the continuation is certain, else (ids, counts, total) of q at i.
        ``uniforms`` None: take the argmax (ties: the most recent); else draw position i with uniforms[i]."""
        kids, count, depth, buf, end = tree.kids, tree.count, tree.depth, tree.buf, tree.end
        tokens: list[int] = []
        rows: list = []
        path_p, score = 1.0, 0.0
        min_p = self.min_token_prob
        for i in range(max_len):
            if d < depth[node]:  # inside an edge: one continuation
                tokens.append(tree.token(node, d))
                rows.append(None)
                score += path_p
                d += 1
                continue
            ch = kids[node]
            if not ch:
                break
            if len(ch) == 1:
                ((tok, child),) = ch.items()
                tokens.append(tok)
                rows.append(None)
                score += path_p
                node, d = child, d + 1
                continue
            children = list(ch.values())
            counts = [count[c] for c in children]
            total, top = sum(counts), max(counts)
            if path_p * top / total < min_p:  # decided before drawing, so the draw stays unbiased
                break
            ids = list(ch)
            if uniforms is not None:
                pick = self._draw(ids, counts, total, uniforms[i])
            elif counts.count(top) == 1:
                pick = counts.index(top)
            else:  # ties: the most recent occurrence
                pick = max((j for j, c in enumerate(counts) if c == top),
                           key=lambda j: (buf[children[j]], end[children[j]]))
            path_p *= counts[pick] / total
            score += path_p
            tokens.append(ids[pick])
            rows.append((ids, counts, total))
            node, d = children[pick], d + 1
        return tokens, rows, score

    @staticmethod
    def _draw(ids: list[int], counts: list[int], total: int, u: float) -> int:
        """Inverse-CDF draw of an index i with probability counts[i] / total (= q(ids[i]))."""
        threshold = u * total
        acc = 0
        for i, c in enumerate(counts):
            acc += c
            if threshold < acc:
                return i
        return len(counts) - 1

    def propose(self, seq: SequenceState, k: int) -> Proposal | TreeProposal:
        state = self._sync(seq)
        device = seq.target.device
        best = None
        for tree, node, m, max_len in self._candidates(state, k):  # the source is chosen before any draw
            tokens, rows, score = self._walk(tree, node, m, max_len)
            if best is None or (score, m) > best[0]:  # ties: the longer match
                best = ((score, m), tree, node, m, max_len, tokens, rows)
        if best is None:
            return Proposal.empty(device)
        _, tree, node, m, max_len, tokens, rows = best
        budget = node_budget(self.tree, seq)
        if budget:
            return self.propose_tree(tree, node, m, max_len, device, budget)
        if not seq.sampling.greedy and any(r is not None for r in rows):
            u = torch.rand(max_len, generator=seq.rng, device=seq.rng.device, dtype=torch.float64).tolist()
            tokens, rows, _ = self._walk(tree, node, m, max_len, u)
        if not tokens:
            return Proposal.empty(device)
        if seq.sampling.greedy or all(r is None for r in rows):
            return Proposal.point_mass(tokens).to(device)  # argmax (or a certain continuation): one-hot q
        return Proposal(torch.tensor(tokens, device=device), q_from_counts(rows, tokens, seq.target.vocab_size, device))

    def propose_tree(self, tree: SuffixTree, node: int, d: int, max_len: int, device,
                     budget: int) -> TreeProposal | Proposal:
        """Several continuations of the point ``d`` tokens deep on ``node`` (the match the chain would draft
        from): the nodes of highest estimated path probability (the product of continuation frequencies), at
        most ``tree`` of them, depth <= ``max_len``, each at least ``min_token_prob``; siblings most frequent
        first (ties: the most recent). Deterministic candidates: point masses (q=None), exact at any
        temperature."""
        tokens, parents, _ = best_first(lambda at: self._continuations(tree, *at), (node, d), budget, max_len,
                                        self.min_token_prob)
        return point_mass_tree(tokens, parents, device) if tokens else Proposal.empty(device)

    @staticmethod
    def _continuations(tree: SuffixTree, node: int, d: int) -> list[tuple[int, float, tuple[int, int]]]:
        """(token, frequency, point after it) of every continuation of the point ``d`` deep on ``node``, most
        frequent first (ties: the most recent occurrence)."""
        if d < tree.depth[node]:  # inside an edge: one continuation
            return [(tree.token(node, d), 1.0, (node, d + 1))]
        ch = tree.kids[node]
        if not ch:
            return []
        count, buf, end = tree.count, tree.buf, tree.end
        total = sum(count[c] for c in ch.values())
        ranked = sorted(ch.items(), key=lambda kv: (count[kv[1]], buf[kv[1]], end[kv[1]]), reverse=True)
        return [(tok, count[c] / total, (c, d + 1)) for tok, c in ranked]

    def memory_bytes(self) -> int:
        return self.cache.memory_bytes() + sum(s.memory_bytes() for s in list(self._live))

    def stats(self) -> dict:
        out = self.cache.stats()
        out["active_requests"] = len(self._live)
        out["memory_bytes"] = self.memory_bytes()
        return out


@hookimpl
def register_proposers(register):
    register("suffix", SuffixProposer,
             "Suffix tree over prompt + output and earlier outputs; q = continuation frequencies.")
