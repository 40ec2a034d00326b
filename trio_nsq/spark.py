"""The PySpark connector's public name: `from trio_nsq.spark import NSQDataSource`, then
`spark.dataSource.register(NSQDataSource)` (trio_nsq.shared.spark; pyspark is the `spark` extra and is
imported only when the class is asked for)."""

from typing import Any

__all__ = ["NSQDataSource"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from trio_nsq.shared.spark import datasource

        return getattr(datasource, name)
    raise AttributeError(f"module 'trio_nsq.spark' has no attribute {name!r}")
