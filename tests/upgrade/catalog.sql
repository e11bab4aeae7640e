-- The SQL surface of pg_remus in the current database, one line per fact, sorted: what an
-- upgraded database must share with a fresh CREATE EXTENSION of the same version.
-- Read by tests/tests/upgrade_catalog.rs (CI) and scripts/upgrade-test.sh (opt-in tier): each
-- runs it in both databases and diffs the lines.
--
-- Covered: the extension row (version, schema, config tables); every member object by its
-- description; functions (their whole definition: arguments, result, language, symbol or body,
-- volatility, strictness, security, SET options, parallel safety, cost), owner and ACL;
-- relations in the extension or in schema remus (kind, owner, ACL, options, row security),
-- their columns (type, not null, default, identity, generated, collation, ACL, order),
-- constraints, indexes, triggers, view definitions, sequences; types and enum labels; schemas
-- with owner and ACL; event triggers; casts and operators by description; comments; default
-- privileges; the roles the extension creates (remus_*).
-- Not covered: objects the extension's functions create per table at run time (shells' and
-- shard tables' triggers, remus_shards.*), and rows of its tables.
-- ACLs are compared with NULL read as the object's default ACL (same privileges either way).
WITH ext AS (
    SELECT oid, extname, extversion, extnamespace, extrelocatable, extconfig, extcondition
      FROM pg_catalog.pg_extension
     WHERE extname = 'pg_remus'
),
members AS (
    SELECT d.classid, d.objid
      FROM pg_catalog.pg_depend d
      JOIN ext ON d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass
              AND d.refobjid = ext.oid
              AND d.deptype = 'e'
),
funcs AS (
    SELECT p.*
      FROM pg_catalog.pg_proc p
     WHERE p.oid IN (SELECT objid FROM members WHERE classid = 'pg_catalog.pg_proc'::pg_catalog.regclass)
        OR p.pronamespace = 'remus'::pg_catalog.regnamespace
),
rels AS (
    SELECT c.*
      FROM pg_catalog.pg_class c
     WHERE c.oid IN (SELECT objid FROM members WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass)
        OR (c.relnamespace = 'remus'::pg_catalog.regnamespace AND c.relkind <> 'i')
),
facts(line) AS (
    SELECT pg_catalog.format('extension %s version=%s schema=%s relocatable=%s config=%s condition=%s',
                             extname, extversion, extnamespace::pg_catalog.regnamespace,
                             extrelocatable, extconfig::pg_catalog.regclass[], extcondition)
      FROM ext
    UNION ALL
    SELECT 'member ' || pg_catalog.pg_describe_object(classid, objid, 0) FROM members
    UNION ALL
    -- Functions: the whole definition, line by line (numbered, so sorting keeps the order).
    SELECT pg_catalog.format('function %s line %s: %s', f.oid::pg_catalog.regprocedure,
                             pg_catalog.lpad(l.n::text, 3, '0'), l.line)
      FROM funcs f,
           LATERAL pg_catalog.regexp_split_to_table(pg_catalog.pg_get_functiondef(f.oid), E'\n')
               WITH ORDINALITY AS l(line, n)
     WHERE f.prokind IN ('f', 'p', 'w')
    UNION ALL
    SELECT pg_catalog.format('function %s kind=%s owner=%s acl=%s', f.oid::pg_catalog.regprocedure,
                             f.prokind, f.proowner::pg_catalog.regrole,
                             COALESCE(f.proacl, pg_catalog.acldefault('f', f.proowner)))
      FROM funcs f
    UNION ALL
    SELECT pg_catalog.format('aggregate %s final=%s trans=%s stype=%s', a.aggfnoid::pg_catalog.regprocedure,
                             a.aggfinalfn, a.aggtransfn, a.aggtranstype::pg_catalog.regtype)
      FROM pg_catalog.pg_aggregate a
     WHERE a.aggfnoid IN (SELECT oid FROM funcs)
    UNION ALL
    -- Relations.
    SELECT pg_catalog.format('relation %s kind=%s persistence=%s owner=%s acl=%s options=%s rls=%s/%s',
                             c.oid::pg_catalog.regclass, c.relkind, c.relpersistence,
                             c.relowner::pg_catalog.regrole,
                             COALESCE(c.relacl, pg_catalog.acldefault(
                                 (CASE WHEN c.relkind = 'S' THEN 's' ELSE 'r' END)::"char", c.relowner)),
                             c.reloptions, c.relrowsecurity, c.relforcerowsecurity)
      FROM rels c
    UNION ALL
    SELECT pg_catalog.format('relation %s columns in order: %s', c.oid::pg_catalog.regclass,
                             (SELECT pg_catalog.string_agg(a.attname::text, ', ' ORDER BY a.attnum)
                                FROM pg_catalog.pg_attribute a
                               WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped))
      FROM rels c
    UNION ALL
    SELECT pg_catalog.format('column %s.%I type=%s notnull=%s default=%s identity=%s generated=%s collation=%s acl=%s',
                             c.oid::pg_catalog.regclass, a.attname,
                             pg_catalog.format_type(a.atttypid, a.atttypmod), a.attnotnull,
                             pg_catalog.pg_get_expr(ad.adbin, ad.adrelid), a.attidentity,
                             a.attgenerated, NULLIF(a.attcollation, 0)::pg_catalog.regcollation,
                             a.attacl)
      FROM rels c
      JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
      LEFT JOIN pg_catalog.pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
    UNION ALL
    SELECT pg_catalog.format('constraint %s %I: %s', c.oid::pg_catalog.regclass, k.conname,
                             pg_catalog.pg_get_constraintdef(k.oid))
      FROM rels c
      JOIN pg_catalog.pg_constraint k ON k.conrelid = c.oid
    UNION ALL
    SELECT pg_catalog.format('index %s: %s', c.oid::pg_catalog.regclass, pg_catalog.pg_get_indexdef(i.indexrelid))
      FROM rels c
      JOIN pg_catalog.pg_index i ON i.indrelid = c.oid
    UNION ALL
    SELECT pg_catalog.format('trigger %s: %s enabled=%s', c.oid::pg_catalog.regclass,
                             pg_catalog.pg_get_triggerdef(t.oid), t.tgenabled)
      FROM rels c
      JOIN pg_catalog.pg_trigger t ON t.tgrelid = c.oid AND NOT t.tgisinternal
    UNION ALL
    SELECT pg_catalog.format('view %s line %s: %s', c.oid::pg_catalog.regclass,
                             pg_catalog.lpad(l.n::text, 3, '0'), l.line)
      FROM rels c,
           LATERAL pg_catalog.regexp_split_to_table(pg_catalog.pg_get_viewdef(c.oid), E'\n')
               WITH ORDINALITY AS l(line, n)
     WHERE c.relkind IN ('v', 'm')
    UNION ALL
    SELECT pg_catalog.format('rule %s %I: %s', c.oid::pg_catalog.regclass, r.rulename,
                             pg_catalog.pg_get_ruledef(r.oid))
      FROM rels c
      JOIN pg_catalog.pg_rewrite r ON r.ev_class = c.oid AND r.rulename <> '_RETURN'
    UNION ALL
    SELECT pg_catalog.format('sequence %s type=%s start=%s inc=%s min=%s max=%s cache=%s cycle=%s',
                             s.seqrelid::pg_catalog.regclass, s.seqtypid::pg_catalog.regtype,
                             s.seqstart, s.seqincrement, s.seqmin, s.seqmax, s.seqcache, s.seqcycle)
      FROM pg_catalog.pg_sequence s
     WHERE s.seqrelid IN (SELECT oid FROM rels)
    UNION ALL
    -- Types (composite types' columns are covered as relations of kind c).
    SELECT pg_catalog.format('type %s type=%s owner=%s acl=%s base=%s notnull=%s default=%s',
                             t.oid::pg_catalog.regtype, t.typtype, t.typowner::pg_catalog.regrole,
                             COALESCE(t.typacl, pg_catalog.acldefault('T', t.typowner)),
                             NULLIF(t.typbasetype, 0)::pg_catalog.regtype, t.typnotnull, t.typdefault)
      FROM pg_catalog.pg_type t
     WHERE t.oid IN (SELECT objid FROM members WHERE classid = 'pg_catalog.pg_type'::pg_catalog.regclass)
        OR (t.typnamespace = 'remus'::pg_catalog.regnamespace AND t.typtype <> 'c' AND t.typelem = 0)
    UNION ALL
    SELECT pg_catalog.format('enum %s: %s', e.enumtypid::pg_catalog.regtype,
                             pg_catalog.string_agg(e.enumlabel::text, ', ' ORDER BY e.enumsortorder))
      FROM pg_catalog.pg_enum e
     WHERE e.enumtypid IN (SELECT objid FROM members WHERE classid = 'pg_catalog.pg_type'::pg_catalog.regclass)
     GROUP BY e.enumtypid
    UNION ALL
    SELECT pg_catalog.format('domain constraint %s %I: %s', k.contypid::pg_catalog.regtype, k.conname,
                             pg_catalog.pg_get_constraintdef(k.oid))
      FROM pg_catalog.pg_constraint k
     WHERE k.contypid IN (SELECT objid FROM members WHERE classid = 'pg_catalog.pg_type'::pg_catalog.regclass)
    UNION ALL
    SELECT pg_catalog.format('schema %I owner=%s acl=%s', n.nspname, n.nspowner::pg_catalog.regrole,
                             COALESCE(n.nspacl, pg_catalog.acldefault('n', n.nspowner)))
      FROM pg_catalog.pg_namespace n
     WHERE n.oid IN (SELECT objid FROM members WHERE classid = 'pg_catalog.pg_namespace'::pg_catalog.regclass)
    UNION ALL
    SELECT pg_catalog.format('event trigger %I event=%s function=%s tags=%s enabled=%s', e.evtname,
                             e.evtevent, e.evtfoid::pg_catalog.regprocedure, e.evttags, e.evtenabled)
      FROM pg_catalog.pg_event_trigger e
     WHERE e.oid IN (SELECT objid FROM members WHERE classid = 'pg_catalog.pg_event_trigger'::pg_catalog.regclass)
    UNION ALL
    -- Comments on every member (and its columns) and on the remus relations.
    SELECT pg_catalog.format('comment on %s: %s',
                             pg_catalog.pg_describe_object(d.classoid, d.objoid, d.objsubid), d.description)
      FROM pg_catalog.pg_description d
     WHERE (d.classoid, d.objoid) IN (SELECT classid, objid FROM members)
        OR (d.classoid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.objoid IN (SELECT oid FROM rels))
        OR (d.classoid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND d.objoid IN (SELECT oid FROM funcs))
    UNION ALL
    SELECT pg_catalog.format('default privileges role=%s schema=%s type=%s acl=%s',
                             a.defaclrole::pg_catalog.regrole, a.defaclnamespace::pg_catalog.regnamespace,
                             a.defaclobjtype, a.defaclacl)
      FROM pg_catalog.pg_default_acl a
     WHERE a.defaclnamespace IN (SELECT objid FROM members WHERE classid = 'pg_catalog.pg_namespace'::pg_catalog.regclass)
    UNION ALL
    -- The roles the extension creates (cluster-wide objects, not members).
    SELECT pg_catalog.format('role %I super=%s inherit=%s createrole=%s createdb=%s login=%s bypassrls=%s comment=%s',
                             r.rolname, r.rolsuper, r.rolinherit, r.rolcreaterole, r.rolcreatedb,
                             r.rolcanlogin, r.rolbypassrls,
                             pg_catalog.shobj_description(r.oid, 'pg_authid'))
      FROM pg_catalog.pg_roles r
     WHERE r.rolname LIKE 'remus\_%'
)
SELECT line FROM facts ORDER BY line COLLATE "C";
