"""Spark's auto-discovery hook for the "nsq" format: at start-up Spark imports every top-level module whose
name starts with `pyspark_` and registers its `DefaultSource`. Needs a regular install of the package
(`pip install 'trio-nsq[spark]'`); an editable install hides top-level modules from that scan, so there
call `spark.dataSource.register(NSQDataSource)` instead."""

from trio_nsq.spark.datasource import NSQDataSource as DefaultSource

__all__ = ["DefaultSource"]
