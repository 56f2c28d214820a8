"""The dependent sampling tree of Xie et al. (NeurIPS 2022, sec. 4), in its chain form.

Order the jobs j_1..j_n by the size of their remaining sets (ascending, ties by overlap). The
paper's tree then is a chain: node k holds the jobs {j_k..j_n}; its *vertex* is

    I_k = (R_{j_k} ∩ ... ∩ R_{j_n}) \\ (I_1 ∪ ... ∪ I_{k-1})

and the *leaf* of j_k is L_k = R_{j_k} \\ (I_1 ∪ ... ∪ I_k) (L_n is empty). With the suffix
intersections S_k = R_{j_k} ∩ ... ∩ R_{j_n} (so S_1 ⊆ S_2 ⊆ ... ⊆ S_n = R_{j_n}) the union
I_1 ∪ ... ∪ I_k telescopes to S_k, hence

    I_k = S_k \\ S_{k-1},      L_k = R_{j_k} \\ S_k,

which is what `build_chain` computes: about 3n bitmap operations. Each remaining set is
partitioned along its path: R_{j_k} = I_1 ⊔ ... ⊔ I_k ⊔ L_k.

Insertion and deletion (the paper's Figure 4). Inserting a job whose remaining set is smaller
than all others puts it at the root: the old root vertex splits into the new intersection and
the remainder, which becomes part of the next node; inserting a larger one appends it at the
bottom and splits the last leaf. Deleting a job merges its vertex into its neighbours. All three
produce exactly the tree that `build_chain` gives for the new ordered list of remaining sets,
because the tree is a function of that list alone; so the sampler rebuilds instead of splicing.
The rebuild is O(n) set operations of about 15 us each on 1-2M-item sets, well below the cost of
a splice written in Python.

What the chain can and cannot share. A vertex is an intersection of a *suffix* of the size
order, so only items held by a whole suffix {j_k..j_n} can be shared by all jobs that select
that vertex. Items shared by a subset that is not a suffix are not exploited as such: for jobs
ordered 1 < 2 < 3, items held by jobs 1 and 3 but not by 2 lie in L_1 for job 1 and in I_3 (or
L_2 ...) for job 3, so jobs 1 and 3 receive them in the same round only by chance. For two jobs
the chain is the whole tree and reaches the Theorem 1 bound. For nested datasets (each job's
set contains the smaller ones', the usual case of tuning runs on subsets), every shared subset is
a suffix and nothing is lost.

The order among jobs of equal size matters too, so `chain_order` breaks ties by overlap: within
a group of equal sizes it places, from the back, the job that keeps the suffix intersection
largest (the first pick being one of the group's most-overlapping pair). For jobs a = b = 0:50
and c = 25:75 that gives (c, a, b): a and b share 100% of rounds and each shares 50% with c,
every pairwise bound. Ordering ties by job id instead gave (a, b, c), and a and b shared 52%.

The n-job sharing rate: in a round, the selectors of one vertex share one item, so the number
of distinct items a round prepares is the number of vertices selected by someone plus the number
of leaf draws (formula in joader.sampling.dependent). It is 1 for identical datasets; for 32 jobs
on random 80%-overlapping subsets it is about 28 of 32 (bench/micro/sampler.py), because the
intersection of a long suffix of random subsets is nearly empty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pyroaring import AbstractBitMap, BitMap

__all__ = ["build_chain", "chain_order"]

# Above this many jobs of one size, the first pick of a tie group skips the O(g^2) pair search.
_MAX_PAIR_SEARCH = 16


def chain_order(remaining: Mapping[str, AbstractBitMap]) -> list[str]:
    """Job ids by ascending remaining size; equal sizes ordered to share the most (see above).

    Deterministic: a function of the sets and the ids alone.
    """
    by_size = sorted(remaining, key=lambda job_id: (len(remaining[job_id]), job_id))
    reversed_order: list[str] = []
    suffix: AbstractBitMap | None = None  # intersection of the jobs placed so far (the back)
    start = len(by_size)
    while start > 0:
        size = len(remaining[by_size[start - 1]])
        end = start
        while start > 0 and len(remaining[by_size[start - 1]]) == size:
            start -= 1
        group = by_size[start:end]
        while group:
            pick = _pick_last(group, remaining, suffix)
            group.remove(pick)
            reversed_order.append(pick)
            suffix = remaining[pick] if suffix is None else suffix & remaining[pick]
    return reversed_order[::-1]


def _pick_last(group: list[str], remaining: Mapping[str, AbstractBitMap],
               suffix: AbstractBitMap | None) -> str:
    if len(group) == 1:
        return group[0]
    if suffix is not None:
        # max() keeps the first of equals: the smallest id, since the group is sorted by id.
        return max(group, key=lambda job_id: remaining[job_id].intersection_cardinality(suffix))
    if len(group) > _MAX_PAIR_SEARCH:
        return group[0]
    best, best_overlap = group[0], -1
    for i, first in enumerate(group):
        for second in group[i + 1:]:
            overlap = remaining[first].intersection_cardinality(remaining[second])
            if overlap > best_overlap:
                best, best_overlap = first, overlap
    return best


def build_chain(remaining: Sequence[AbstractBitMap]) -> tuple[list[BitMap], list[BitMap]]:
    """The vertices I_1..I_n and leaves L_1..L_n of the chain for these ordered remaining sets.

    `remaining[k]` is R of the k-th job in chain order (the caller chooses the order; any order
    gives a valid partition, the ascending size order gives the most sharing). Returns new
    bitmaps; the inputs are not modified.
    """
    n = len(remaining)
    if n == 0:
        return [], []
    suffix: list[BitMap] = [BitMap()] * n
    acc = BitMap() | remaining[n - 1]
    suffix[n - 1] = acc
    for k in range(n - 2, -1, -1):
        acc = acc & remaining[k]  # the left operand's type wins: keep a mutable BitMap
        suffix[k] = acc
    inner = [BitMap() | suffix[0]]
    inner.extend(suffix[k] - suffix[k - 1] for k in range(1, n))
    leaves = [_mutable(remaining[k] - suffix[k]) for k in range(n)]
    return inner, leaves


def _mutable(bitmap: AbstractBitMap) -> BitMap:
    return bitmap if type(bitmap) is BitMap else BitMap() | bitmap
