"""`tandem serve --planner`'s settings: the SLOs it sizes the pools for, its node profile, its pace and bounds
(the planner: cluster/planner/, docs/planner.md)."""

from __future__ import annotations

from dataclasses import dataclass

from settings.spec import ConfigError, setting


@dataclass(frozen=True)
class PlannerSettings:
    planner: bool = setting(False, "size the prefill and decode pools from the load and the SLOs (needs "
                                   "--planner-profile, --slo-ttft-ms and --slo-itl-ms)")
    planner_profile: str | None = setting(None, "the node profile the planner sizes with (`tandem profile`)",
                                          metavar="FILE")
    slo_ttft_ms: float | None = setting(None, "time-to-first-token objective, milliseconds", minimum=0.001,
                                        metavar="MS")
    slo_itl_ms: float | None = setting(None, "inter-token-latency objective, milliseconds", minimum=0.001,
                                       metavar="MS")
    slo_percentile: float = setting(90.0, "the percentile of the requests the SLOs hold for", minimum=1.0,
                                    metavar="P")
    planner_interval_s: float = setting(10.0, "seconds between the planner's decisions", minimum=0.1,
                                        metavar="SECONDS")
    planner_cooldown_s: float = setting(60.0, "at most one change per pool in this many seconds", minimum=0.0,
                                        metavar="SECONDS")
    planner_min_prefill: int = setting(1, "the planner keeps at least this many prefill nodes", minimum=0,
                                       metavar="N")
    planner_max_prefill: int = setting(4, "... and at most this many", minimum=0, metavar="N")
    planner_min_decode: int = setting(1, "the planner keeps at least this many decode nodes", minimum=1,
                                      metavar="N")
    planner_max_decode: int = setting(4, "... and at most this many", minimum=1, metavar="N")

    def __post_init__(self) -> None:
        if not self.planner:
            return
        missing = [flag for flag, value in (("--planner-profile", self.planner_profile),
                                            ("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-itl-ms", self.slo_itl_ms))
                   if value is None]
        if missing:
            raise ConfigError(f"--planner needs {', '.join(missing)}")
        if self.slo_percentile >= 100:
            raise ConfigError(f"--slo-percentile must be below 100, got {self.slo_percentile:g}")
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"planner_min_{role}"), getattr(self, f"planner_max_{role}")
            if low > high:
                raise ConfigError(f"--planner-min-{role} {low} is more than --planner-max-{role} {high}")
