fetch('/openapi.json').then(r => r.json()).then(doc => {
  const ops = document.getElementById('ops'); ops.textContent = '';
  const schema = s => s && s.$ref ? doc.components.schemas[s.$ref.split('/').pop()] : s;
  for (const [path, item] of Object.entries(doc.paths)) {
    for (const [method, op] of Object.entries(item)) {
      const d = document.createElement('details'); d.className = 'op';
      const s = document.createElement('summary');
      s.innerHTML = '<span class="m ' + method + '">' + method + '</span> <code></code> <span class="role"></span><div class="sum"></div>';
      s.querySelector('code').textContent = path;
      s.querySelector('.role').textContent = op['x-nrtxn-role'];
      s.querySelector('.sum').textContent = op.summary;
      d.appendChild(s);
      const body = op.requestBody && schema(op.requestBody.content['application/json'].schema);
      const ok = schema(op.responses['200'].content['application/json'].schema);
      for (const [label, v] of [['request body', body], ['200', ok]]) {
        if (!v) continue;
        const p = document.createElement('pre');
        p.textContent = label + ': ' + JSON.stringify(v, null, 1);
        d.appendChild(p);
      }
      ops.appendChild(d);
    }
  }
});
