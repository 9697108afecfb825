"""A fleet's size over time: the ingress records the number of live replicas each time it
changes; `series` reads it back as change points (a step function)."""

from __future__ import annotations

from sqlalchemy import insert, select
from sqlalchemy.engine import Engine

from appliance.telemetry.models import FleetSize
from appliance.telemetry.store import using_engine


def record(target: Engine | str, fleet_id: str, replicas: int, at: float) -> None:
    """Store that `fleet_id` has `replicas` live replicas from `at` on."""
    with using_engine(target) as engine, engine.begin() as conn:
        conn.execute(insert(FleetSize).values(fleet_id=fleet_id, at=at, replicas=replicas))


def series(target: Engine | str, fleet_id: str, since: float, until: float) -> list[tuple[float, int]]:
    """(time, replicas) change points within [since, until), led by the size in force at `since`
    (when one was recorded before it)."""
    t = FleetSize.__table__
    scoped = select(t.c.at, t.c.replicas).where(t.c.fleet_id == fleet_id)
    with using_engine(target) as engine, engine.connect() as conn:
        before = conn.execute(scoped.where(t.c.at < since).order_by(t.c.at.desc()).limit(1)).first()
        rows = conn.execute(scoped.where(t.c.at >= since, t.c.at < until).order_by(t.c.at)).all()
    points = [(float(at), int(n)) for at, n in rows]
    if before is not None:
        points.insert(0, (since, int(before[1])))
    return points


def series_by_fleet(target: Engine | str, since: float, until: float) -> dict[str, list[tuple[float, int]]]:
    """`series` of every fleet that had a size in force within [since, until) (a store normally
    holds one fleet's; a dashboard draws each one it finds)."""
    t = FleetSize.__table__
    with using_engine(target) as engine:
        with engine.connect() as conn:
            fleet_ids = conn.execute(select(t.c.fleet_id).where(t.c.at < until).distinct()).scalars().all()
        found = {fleet_id: series(engine, fleet_id, since, until) for fleet_id in sorted(fleet_ids)}
    return {fleet_id: points for fleet_id, points in found.items() if points}
