// nrtxn's dashboard: one shop at a time, read through the public API with the user's
// access key (if the server has keys). Operators get the live figures
// (GET .../stats, once a second), the items kept live by the push stream
// (GET .../events/stream, read with fetch so that the key goes in a header, never in a
// URL), the last refused requests and the CSV load. A seller's key sees the items only
// (GET .../items, every 2 s): what the key may read, nothing more.
'use strict';

/** Most items the table shows (the first ones in item order). */
const ITEMS_SHOWN_MAX = 1000;
/** Lines per load call: the CLI's batch. */
const CSV_BATCH_LINES = 1000;
/** Where the key is kept: this tab only, gone when it closes. */
const KEY_STORE = 'nrtxn.key';
const ROLE_RANK = { seller: 1, operator: 2, admin: 3 };
const STATS_EVERY_MS = 1000;
const SELLER_ITEMS_EVERY_MS = 2000;
/** Refused requests listed (the server keeps a few more). */
const REFUSED_SHOWN = 10;

const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

let key = sessionStorage.getItem(KEY_STORE) || '';
/** What the key may see: `{ keysRequired, id, shop, role }`. */
let who = null;
/** The shop on screen: its abort signal, its rows by item, its stream cursor. */
let view = null;

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (key) h.Authorization = 'Bearer ' + key;
  return h;
}

/** One API call: `{ status, body }` (body `null` when not JSON). */
async function api(path, opts) {
  opts = opts || {};
  const h = headers(opts.json !== undefined ? { 'Content-Type': 'application/json' } : {});
  const res = await fetch(path, {
    method: opts.method || 'GET',
    headers: h,
    body: opts.json !== undefined ? JSON.stringify(opts.json) : undefined,
    signal: opts.signal,
  });
  let body = null;
  try { body = await res.json(); } catch (_) { /* not JSON */ }
  return { status: res.status, body };
}

const detail = (body) => (body && (body.detail || body.error)) || '';
const shopPath = (shop, rest) => '/v1/shops/' + encodeURIComponent(shop) + '/' + rest;
const isOperator = () => ROLE_RANK[who.role] >= ROLE_RANK.operator;

function notice(text) {
  $('notice').textContent = text || '';
  $('notice').hidden = !text;
}

function shopFromHash() {
  const m = /^#shop=(.+)$/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : '';
}

// ---- key and start -------------------------------------------------------------------

async function start() {
  let r;
  try {
    r = await api('/v1/whoami');
  } catch (e) {
    notice('The server does not answer (' + e.message + '); trying again.');
    setTimeout(start, 2000);
    return;
  }
  notice('');
  if (r.status === 401) {
    askKey(key ? 'That key was refused: ' + detail(r.body) : '');
    return;
  }
  if (r.status !== 200) {
    notice('GET /v1/whoami: ' + r.status + ' ' + detail(r.body));
    return;
  }
  const k = r.body.key;
  who = r.body.keys_required
    ? { keysRequired: true, id: k.id, shop: k.shop, role: k.role }
    : { keysRequired: false, id: null, shop: null, role: 'admin' };
  $('key-panel').hidden = true;
  $('forget-key').hidden = !who.keysRequired;
  $('who').textContent = who.keysRequired
    ? 'key ' + who.id + ': ' + who.role + (who.shop ? ' of ' + who.shop : ' of every shop')
    : 'this server takes requests without keys';
  // A shop's key sees its own shop only.
  $('shop').disabled = !!who.shop;
  const shop = who.shop || shopFromHash();
  if (shop) {
    $('shop').value = shop;
    openShop(shop);
  } else {
    $('shop').focus();
  }
}

function askKey(error) {
  if (view) view.abort.abort();
  view = null;
  $('main').hidden = true;
  $('key-panel').hidden = false;
  $('key-error').textContent = error || '';
  $('key').value = '';
  $('key').focus();
}

$('key-form').addEventListener('submit', (e) => {
  e.preventDefault();
  key = $('key').value.trim();
  sessionStorage.setItem(KEY_STORE, key);
  start();
});

$('forget-key').addEventListener('click', () => {
  key = '';
  sessionStorage.removeItem(KEY_STORE);
  $('who').textContent = '';
  askKey('');
});

$('shop-form').addEventListener('submit', (e) => {
  e.preventDefault();
  const shop = $('shop').value.trim();
  if (shop) openShop(shop);
});

window.addEventListener('hashchange', () => {
  const shop = shopFromHash();
  if (who && !who.shop && shop && (!view || view.shop !== shop)) {
    $('shop').value = shop;
    openShop(shop);
  }
});

// ---- one shop ------------------------------------------------------------------------

function openShop(shop) {
  if (view) view.abort.abort();
  view = { shop, abort: new AbortController(), rows: new Map(), more: false };
  if (shopFromHash() !== shop) history.replaceState(null, '', '#shop=' + encodeURIComponent(shop));
  document.title = shop + ' · nrtxn';
  $('main').hidden = false;
  for (const el of document.querySelectorAll('.operator-only')) el.hidden = !isOperator();
  $('items').tBodies[0].textContent = '';
  $('refused').tBodies[0].textContent = '';
  $('statuses').tBodies[0].textContent = '';
  $('csv-result').textContent = '';
  updateCount();
  if (isOperator()) {
    // The stream first, then the list: an event between the two is not missed (a row
    // keeps the higher seq of what it hears from either).
    followStream(view, () => listItems(view));
    pollStats(view);
  } else {
    setLive(null, 'refreshed every 2 s');
    pollItems(view);
  }
}

async function listItems(v) {
  let after = '';
  let shown = 0;
  for (;;) {
    const limit = Math.min(1000, ITEMS_SHOWN_MAX - shown);
    const q = 'items?limit=' + limit + (after ? '&after=' + encodeURIComponent(after) : '');
    const r = await api(shopPath(v.shop, q), { signal: v.abort.signal });
    if (r.status !== 200) {
      notice('GET items: ' + r.status + ' ' + detail(r.body));
      if (r.status === 401) askKey('The key was refused: ' + detail(r.body));
      return;
    }
    for (const it of r.body.items) {
      upsert(v, it.item, {
        stock: it.stock, reserved: it.reserved, seq: it.seq,
        window: windowText(it.opens_at, it.closes_at),
      });
    }
    shown += r.body.items.length;
    after = r.body.next;
    if (!after || shown >= ITEMS_SHOWN_MAX) {
      v.more = !!after;
      updateCount();
      return;
    }
  }
}

async function pollItems(v) {
  while (!v.abort.signal.aborted) {
    try { await listItems(v); } catch (_) { if (v.abort.signal.aborted) return; }
    await sleep(SELLER_ITEMS_EVERY_MS);
  }
}

/** A row's new state, if it is newer than what the row shows (by seq). */
function upsert(v, item, state) {
  let row = v.rows.get(item);
  if (!row) {
    if (v.rows.size >= ITEMS_SHOWN_MAX) { v.more = true; updateCount(); return; }
    row = makeRow(item);
    v.rows.set(item, row);
    insertSorted($('items').tBodies[0], row, item);
    updateCount();
  } else if (state.seq <= Number(row.dataset.seq)) {
    return;
  }
  row.dataset.seq = state.seq;
  row.cells[1].textContent = state.stock;
  row.cells[2].textContent = state.reserved;
  row.cells[3].textContent = state.seq;
  if (state.window !== undefined) row.cells[5].textContent = state.window;
  if (state.change) {
    row.cells[4].textContent = state.change;
    row.classList.remove('changed');
    void row.offsetWidth; // restart the flash
    row.classList.add('changed');
  }
}

function makeRow(item) {
  const tr = document.createElement('tr');
  tr.dataset.item = item;
  tr.dataset.seq = -1;
  for (const cls of ['item', 'stock num', 'reserved num', 'seq num', 'change', 'window']) {
    const td = document.createElement('td');
    td.className = cls;
    tr.appendChild(td);
  }
  tr.cells[0].textContent = item;
  tr.cells[4].textContent = '—';
  tr.cells[5].textContent = '—';
  return tr;
}

function insertSorted(tbody, row, item) {
  // Item order is the server's: by bytes, which for these names is by UTF-16 code unit
  // but for characters past the BMP; close enough for a table.
  for (const r of tbody.rows) {
    if (r.dataset.item > item) { tbody.insertBefore(row, r); return; }
  }
  tbody.appendChild(row);
}

function updateCount() {
  const n = view ? view.rows.size : 0;
  $('items-count').textContent = '(' + n.toLocaleString() + (view && view.more ? ' shown, more in the shop' : '') + ')';
}

function setLive(on, text) {
  const el = $('live');
  el.className = 'live' + (on === true ? ' on' : on === false ? ' off' : '');
  el.textContent = text;
}

// ---- the push stream -----------------------------------------------------------------

async function followStream(v, onReady) {
  let cursor = null;
  let listed = false;
  while (!v.abort.signal.aborted) {
    try {
      const h = headers({ Accept: 'text/event-stream' });
      if (cursor) h['Last-Event-ID'] = cursor;
      const res = await fetch(shopPath(v.shop, 'events/stream'), { headers: h, signal: v.abort.signal });
      if (res.status !== 200) {
        let body = null;
        try { body = await res.json(); } catch (_) { /* not JSON */ }
        setLive(false, 'stream: ' + res.status + ' ' + detail(body));
        if (res.status === 401) { askKey('The key was refused: ' + detail(body)); return; }
        if (res.status === 400 && cursor) {
          // The cursor is no longer one the server can resume from: start from now, and
          // list the items again for what was missed.
          cursor = null;
          listed = false;
        }
        await sleep(2000);
        continue;
      }
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buf = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let end;
        while ((end = buf.indexOf('\n\n')) >= 0) {
          const msg = parseMessage(buf.slice(0, end));
          buf = buf.slice(end + 2);
          if (msg.id) cursor = msg.id;
          if (msg.event === 'ready') {
            setLive(true, 'live');
            if (!listed) { listed = true; onReady(); }
          } else if (msg.event === 'dropped') {
            const d = JSON.parse(msg.data || '{}');
            if (d.resume_after) cursor = d.resume_after;
            setLive(false, 'stream dropped (' + (d.reason || '?') + '), resuming');
          } else if (msg.event === 'message' && msg.data) {
            onEvent(v, JSON.parse(msg.data));
          }
        }
      }
    } catch (e) {
      if (v.abort.signal.aborted) return;
      setLive(false, 'stream: ' + e.message);
    }
    await sleep(1000);
  }
}

/** One server-sent message: its `id`, `event` (default `message`) and `data`. */
function parseMessage(block) {
  const msg = { id: null, event: 'message', data: '' };
  for (const line of block.split('\n')) {
    if (line.startsWith(':')) continue;
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
    if (field === 'id') msg.id = value;
    else if (field === 'event') msg.event = value;
    else if (field === 'data') msg.data += (msg.data ? '\n' : '') + value;
  }
  return msg;
}

function onEvent(v, e) {
  const what = e.kind + (e.status === 'ok' ? '' : ' (' + e.status + ')');
  // A partial fill took less than it asked for: both are shown.
  const partial = e.status === 'ok' && e.qty_taken != null && e.qty_taken < e.qty;
  const qty = partial ? e.qty_taken + ' of ' + e.qty : e.qty;
  upsert(v, e.item, {
    stock: e.stock_after,
    reserved: e.reserved_after,
    seq: e.seq,
    change: clock(e.at) + ' ' + what + (e.qty ? ' ' + qty : ''),
    window: windowText(e.opens_at, e.closes_at),
  });
}

// An item's sale window, as its bounds (ms since the epoch, absent when unset) say.
function windowText(opensAt, closesAt) {
  const at = (ms) => new Date(ms).toLocaleString([], { hour12: false });
  const parts = [];
  if (opensAt) parts.push('opens ' + at(opensAt));
  if (closesAt) parts.push('closes ' + at(closesAt));
  return parts.length ? parts.join(', ') : '—';
}

const clock = (ms) => new Date(ms).toLocaleTimeString([], { hour12: false });

// ---- figures -------------------------------------------------------------------------

async function pollStats(v) {
  while (!v.abort.signal.aborted) {
    try {
      const r = await api(shopPath(v.shop, 'stats'), { signal: v.abort.signal });
      if (r.status === 200) drawStats(r.body);
      else if (r.status === 401) { askKey('The key was refused: ' + detail(r.body)); return; }
      else if (r.status === 403) { $('figures').hidden = true; return; }
    } catch (_) {
      if (v.abort.signal.aborted) return;
    }
    await sleep(STATS_EVERY_MS);
  }
}

function drawStats(s) {
  const last = (a) => (a.length ? a[a.length - 1] : null);
  drawChart($('chart-rate'), s.decisions);
  $('rate-now').textContent = (last(s.decisions) || 0).toLocaleString();
  $('rate-max').textContent = 'max ' + Math.max(0, ...s.decisions).toLocaleString() + '/s';
  drawChart($('chart-p99'), s.p99_ms);
  const p99s = s.p99_ms.filter((x) => x !== null);
  $('p99-now').textContent = last(s.p99_ms) === null ? '–' : '≤ ' + last(s.p99_ms);
  $('p99-max').textContent = p99s.length ? 'max ' + Math.max(...p99s) + ' ms' : '';

  const tbody = $('statuses').tBodies[0];
  tbody.textContent = '';
  const rates = Object.entries(s.rates_per_s).sort((a, b) => b[1] - a[1]);
  if (!rates.length) addRow(tbody, ['no decisions in the last 10 s'], ['muted']);
  for (const [status, rate] of rates) {
    const tr = addRow(tbody, [status, rate.toFixed(1)], [status === 'ok' ? 'status-ok' : 'status-bad', 'num']);
    tr.dataset.status = status;
  }

  const refused = $('refused').tBodies[0];
  refused.textContent = '';
  if (!s.refused.length) addRow(refused, ['none in memory'], ['muted']);
  for (const r of s.refused.slice(0, REFUSED_SHOWN)) {
    const tr = addRow(
      refused,
      [clock(r.at), r.item, r.request_key, r.op, r.qty, r.status, r.reason || ''],
      ['', '', '', '', 'num', 'status-bad', 'muted'],
    );
    tr.dataset.key = r.request_key;
  }
}

function addRow(tbody, cells, classes) {
  const tr = document.createElement('tr');
  cells.forEach((c, i) => {
    const td = document.createElement('td');
    td.textContent = c;
    if (classes[i]) td.className = classes[i];
    tr.appendChild(td);
  });
  tbody.appendChild(tr);
  return tr;
}

/** A small area chart of `values` (one a second; `null`: nothing that second). */
function drawChart(svg, values) {
  const NS = 'http://www.w3.org/2000/svg';
  const w = 240, h = 60;
  const max = Math.max(1, ...values.map((x) => x || 0));
  const step = values.length > 1 ? w / (values.length - 1) : w;
  const pts = values.map((x, i) => (i * step).toFixed(1) + ',' + (h - ((x || 0) / max) * (h - 4)).toFixed(1));
  svg.textContent = '';
  const area = document.createElementNS(NS, 'polygon');
  area.setAttribute('points', '0,' + h + ' ' + pts.join(' ') + ' ' + w + ',' + h);
  const line = document.createElementNS(NS, 'polyline');
  line.setAttribute('points', pts.join(' '));
  svg.append(area, line);
}

// ---- CSV load ------------------------------------------------------------------------

/** Fields of one CSV record: commas separate, double quotes may hold commas and `""`. */
function splitCsv(line) {
  const fields = [];
  let i = 0;
  for (;;) {
    while (line[i] === ' ') i++;
    let f = '';
    if (line[i] === '"') {
      i++;
      for (;;) {
        if (i >= line.length) throw new Error('a quoted field is not closed');
        if (line[i] === '"' && line[i + 1] === '"') { f += '"'; i += 2; continue; }
        if (line[i] === '"') { i++; break; }
        f += line[i++];
      }
      while (line[i] === ' ') i++;
      if (i >= line.length) { fields.push(f); return fields; }
      if (line[i] !== ',') throw new Error(JSON.stringify(line[i]) + ' after a quoted field');
      i++;
      fields.push(f);
    } else {
      for (;;) {
        if (i >= line.length) { fields.push(f.trimEnd()); return fields; }
        if (line[i] === ',') { i++; break; }
        if (line[i] === '"') throw new Error('a quote inside an unquoted field');
        f += line[i++];
      }
      fields.push(f.trimEnd());
    }
  }
}

/** The file's lines to load, and the malformed ones: `{ lines, errors: [[n, why]] }`. */
function parseCsv(text) {
  const raw = text.replace(/^\ufeff/, '').split(/\r?\n/);
  const errors = [];
  const lines = [];
  let header = null;
  raw.forEach((l, i) => {
    const n = i + 1;
    if (!l.trim()) return;
    let fields;
    try { fields = splitCsv(l); } catch (e) { errors.push([n, e.message]); return; }
    if (!header) {
      const names = fields.map((f) => f.toLowerCase());
      const unknown = names.find((c) => !['item', 'stock', 'per_buyer_max'].includes(c));
      if (!names.includes('item') || !names.includes('stock') || unknown !== undefined) {
        throw new Error('line ' + n + ': the header must name the columns item and stock (and optionally per_buyer_max), found ' + fields.join(','));
      }
      header = names;
      return;
    }
    if (fields.length !== header.length) {
      errors.push([n, header.length + ' fields expected, found ' + fields.length]);
      return;
    }
    const get = (c) => fields[header.indexOf(c)];
    const int = (c) => {
      const s = get(c);
      return /^[0-9]{1,16}$/.test(s) ? Number(s) : NaN;
    };
    const entry = { n, item: get('item'), stock: int('stock') };
    if (!entry.item) { errors.push([n, 'item: empty']); return; }
    if (Number.isNaN(entry.stock)) { errors.push([n, 'stock: a whole number of units, at least 0, expected, found ' + JSON.stringify(get('stock'))]); return; }
    if (header.includes('per_buyer_max') && get('per_buyer_max') !== '') {
      entry.per_buyer_max = int('per_buyer_max');
      if (Number.isNaN(entry.per_buyer_max)) { errors.push([n, 'per_buyer_max: a whole number expected, found ' + JSON.stringify(get('per_buyer_max'))]); return; }
    }
    lines.push(entry);
  });
  if (!header) throw new Error('the file is empty: a header line item,stock is expected');
  return { lines, errors };
}

$('csv-load').addEventListener('click', async () => {
  const file = $('csv').files[0];
  const out = $('csv-result');
  if (!file || !view) { out.textContent = 'Choose a CSV file first.'; return; }
  const v = view;
  let parsed;
  try { parsed = parseCsv(await file.text()); } catch (e) { out.textContent = file.name + ': ' + e.message; return; }
  const { lines, errors } = parsed;
  const bar = $('csv-progress');
  bar.hidden = false;
  bar.max = Math.max(1, lines.length);
  bar.value = 0;
  $('csv-load').disabled = true;
  // One run's batches carry its id: a batch sent again after a lost answer is answered
  // with what it did, not applied twice.
  const run = Math.random().toString(36).slice(2, 10);
  let loaded = 0;
  let failed = '';
  try {
    for (let i = 0; i < lines.length && !failed; i += CSV_BATCH_LINES) {
      let batch = lines.slice(i, i + CSV_BATCH_LINES);
      const range = batch[0].n + '-' + batch[batch.length - 1].n;
      let attempt = 0;
      while (batch.length) {
        const items = batch.map((l) => {
          const e = { item: l.item, stock: l.stock };
          if (l.per_buyer_max !== undefined) e.per_buyer_max = l.per_buyer_max;
          return e;
        });
        const request_id = 'dash:' + run + ':' + range + ':' + batch.length;
        let r;
        try {
          r = await api(shopPath(v.shop, 'items'), { method: 'PUT', json: { items, request_id } });
        } catch (e) {
          if (++attempt < 3) { await sleep(500 * attempt); continue; }
          failed = 'lines ' + range + ' not loaded: ' + e.message + '; load the file again to go on';
          break;
        }
        if (r.status === 200) { loaded += batch.length; break; }
        const m = /items\[(\d+)\]/.exec(detail(r.body));
        if ((r.status === 400 || r.status === 409) && m && Number(m[1]) < batch.length) {
          const [bad] = batch.splice(Number(m[1]), 1);
          errors.push([bad.n, detail(r.body).replace(/^items\[\d+\]\.?/, '')]);
          continue;
        }
        failed = 'lines ' + range + ' not loaded: ' + r.status + ' ' + detail(r.body);
        break;
      }
      bar.value = Math.min(lines.length, i + CSV_BATCH_LINES);
    }
  } finally {
    $('csv-load').disabled = false;
  }
  errors.sort((a, b) => a[0] - b[0]);
  let text = 'Loaded ' + loaded.toLocaleString() + ' item' + (loaded === 1 ? '' : 's') + ' from ' + file.name + '.';
  if (errors.length) text += '\n' + errors.length + ' line' + (errors.length === 1 ? '' : 's') + ' not loaded:\n' + errors.map(([n, why]) => 'line ' + n + ': ' + why).join('\n');
  if (failed) text += '\n' + failed;
  out.textContent = text;
  out.className = errors.length || failed ? 'error' : '';
  // Operators see the loads through the stream; refresh the list for items beyond it.
  if (v === view) listItems(v);
});

start();
