"""Hypothesis strategies for every event of the contract, derived from the msgspec types.

Walking `msgspec.inspect` means a new event type or field is covered without editing this
file: the strategies are the contract's own types, constraints included.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec.inspect as mi
from hypothesis import strategies as st

from schemas import events as ev

_NAMES = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=24
)
_TIMES = st.datetimes(
    min_value=datetime(2020, 1, 1), max_value=datetime(2035, 1, 1), timezones=st.just(UTC)
).map(lambda t: t.replace(microsecond=(t.microsecond // 1000) * 1000))


def for_type(t: mi.Type) -> st.SearchStrategy[Any]:
    match t:
        case mi.StructType():
            fields = {f.name: for_type(f.type) for f in t.fields}
            required = {
                k: v for k, v in fields.items() if next(f for f in t.fields if f.name == k).required
            }
            optional = {k: v for k, v in fields.items() if k not in required}
            return st.fixed_dictionaries(required, optional=optional).map(lambda kw: t.cls(**kw))
        case mi.IntType():
            lo = t.ge if t.ge is not None else -(2**31)
            hi = min(t.le, 10_000) if t.le is not None else 10_000
            return st.integers(min_value=lo, max_value=hi)
        case mi.FloatType():
            lo = max(t.ge, -1e6) if t.ge is not None else -1e6
            hi = min(t.le, 1e6) if t.le is not None else 1e6
            return st.floats(min_value=lo, max_value=hi, allow_nan=False)
        case mi.StrType() if t.pattern is not None:
            return st.from_regex(t.pattern, fullmatch=True).filter(
                lambda x: len(x) <= (t.max_length or 10**9)
            )
        case mi.StrType():
            return _NAMES if (t.min_length or 0) > 0 else st.text(max_size=24)
        case mi.BoolType():
            return st.booleans()
        case mi.DateTimeType():
            return _TIMES
        case mi.LiteralType():
            return st.sampled_from(t.values)
        case mi.NoneType():
            return st.none()
        case mi.UnionType():
            return st.one_of(*(for_type(x) for x in t.types))
        case mi.VarTupleType():
            return st.lists(for_type(t.item_type), max_size=3).map(tuple)
        case mi.DictType():
            return st.dictionaries(for_type(t.key_type), for_type(t.value_type), max_size=3)
    raise NotImplementedError(f"no strategy for {t!r}")


def data_of(kind: str) -> st.SearchStrategy[ev.Data]:
    return for_type(mi.type_info(ev.DATA_TYPES[kind]))


def event_of(kind: str) -> st.SearchStrategy[ev.Event]:
    return st.builds(
        lambda data, id, time, source, causation: ev.make(
            data, id=id, time=time, source=source, causation=causation
        ),
        data_of(kind),
        st.text(alphabet="0123456789ABCDEFGHJKMNPQRSTVWXYZ", min_size=26, max_size=26),
        _TIMES,
        st.text(max_size=12),
        st.none() | st.text(min_size=1, max_size=26),
    )


any_event: st.SearchStrategy[ev.Event] = st.sampled_from(sorted(ev.EVENT_TYPES)).flatmap(event_of)
