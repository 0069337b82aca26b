"""Parameter names: wrapper components removed (canonical), classified into layer and module kind
(classify), and re-aggregated per group with the series budget (grouping)."""
